"""Packing tokenized documents into fixed-length sequences (``pack=Pack(...)``):
every token once, the sequences' fields, exact resume (the documents the
packer held read again), and what is refused."""

from __future__ import annotations

import itertools
import json
import pickle
import random
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from _shardtest import load_schema
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import models, pre_tokenizers, trainers
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from shardstream import (
    FieldDecodeError,
    Ledger,
    Mix,
    Pack,
    SampleSkippedWarning,
    StateMismatchError,
    StreamingDataset,
    Tokenizer,
    collate_sequences,
    elastic_state,
)
from shardstream._core import run_cli

SEQ = 16
STATE = jsonschema.Draft202012Validator(load_schema("state"))


def write_docs(folder: Path, shards: int = 3, docs: int = 20, seed: int = 0) -> list[str]:
    """JSON-lines shards of pre-tokenized documents: field ``ids`` of
    document ``d`` of shard ``s`` holds ``(s * 1000 + d) * 100 + t`` for
    ``t`` below its length (1 to 45 tokens: shorter and longer than a
    sequence)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    urls = []
    for s in range(shards):
        path = folder / f"p-{s}.jsonl"
        lines = []
        for d in range(docs):
            n = rng.randint(1, 45)
            lines.append(
                json.dumps({"n": s * 1000 + d, "ids": [(s * 1000 + d) * 100 + t for t in range(n)]})
            )
        path.write_text("\n".join(lines) + "\n")
        urls.append(str(path))
    return urls


def real_tokens(seq: dict[str, Any], pack: Pack) -> list[int]:
    """The tokens of one sequence, padding left out (no test token is the
    padding id)."""
    tokens = list(seq["input_ids"])
    if pack.labels:
        last = int(seq["labels"][-1])
        tokens.append(pack.pad_id if last == -100 else last)
    while tokens and tokens[-1] == pack.pad_id:
        tokens.pop()
    return [int(t) for t in tokens]


OPTIONS = {"seed": 5, "shuffle_buffer": 8, "shuffle_initial": 3}


@pytest.mark.parametrize("labels", [False, True])
def test_concat_gives_every_token_once_in_the_documents_order(tmp_path: Path, labels: bool) -> None:
    urls = write_docs(tmp_path / "d")
    docs = [d["ids"] for d in StreamingDataset(urls, **OPTIONS)]
    pack = Pack(SEQ, field="ids", labels=labels, pad_id=-1)
    packed = StreamingDataset(urls, pack=pack, **OPTIONS)
    seqs = list(packed)
    # stats() counts what was handed out: the sequences, not the documents.
    assert packed.stats()["samples"] == len(seqs) != len(docs)
    width = SEQ if labels else SEQ + 1
    for seq in seqs:
        assert seq["input_ids"].dtype == np.int32 and seq["input_ids"].shape == (width,)
        assert seq["position_ids"].shape == (width,)
        bounds = seq["cu_seqlens"]
        assert bounds[0] == 0 and bounds[-1] == width and np.all(np.diff(bounds) > 0)
        if labels:
            valid = seq["labels"][:-1] != -100
            assert np.array_equal(seq["labels"][:-1][valid], seq["input_ids"][1:][valid])
    flat = [t for seq in seqs for t in real_tokens(seq, pack)]
    assert flat == [t for d in docs for t in d]
    # Only the last sequence is padded.
    assert all(len(real_tokens(s, pack)) == SEQ + 1 for s in seqs[:-1])


def test_best_fit_keeps_each_document_whole_and_pads_little(tmp_path: Path) -> None:
    urls = write_docs(tmp_path / "d", shards=4, docs=40)
    docs = {d["n"]: d["ids"] for d in StreamingDataset(urls, **OPTIONS)}
    pack = Pack(64, mode="best_fit", window=8, field="ids", pad_id=-1)
    seqs = list(StreamingDataset(urls, pack=pack, **OPTIONS))
    seen: dict[int, list[int]] = {}
    for seq in seqs:
        bounds = [int(b) for b in seq["cu_seqlens"]]
        for start, end in itertools.pairwise(bounds):
            piece = [int(t) for t in seq["input_ids"][start:end]]
            if piece[0] == -1:
                assert all(t == -1 for t in piece) and end == len(seq["input_ids"])
                continue
            doc = piece[0] // 100
            assert doc not in seen, f"document {doc} split"
            seen[doc] = piece
            assert list(seq["position_ids"][start:end]) == list(range(end - start))
    assert seen == docs
    # Padding, but in the open sequences handed out at the epoch's end.
    middle = seqs[:-8]
    used = sum(len(real_tokens(s, pack)) for s in middle)
    padding = 1 - used / (len(middle) * 65)
    assert padding < 0.05, padding


def test_batches_stack_the_sequences_with_one_cu_seqlens(tmp_path: Path) -> None:
    urls = write_docs(tmp_path / "d")
    pack = Pack(SEQ, field="ids", labels=True)
    singles = list(StreamingDataset(urls, pack=pack, **OPTIONS))
    batches = list(StreamingDataset(urls, pack=pack, batch_size=4, **OPTIONS))
    assert batches[0]["input_ids"].shape == (4, SEQ) and batches[0]["labels"].shape == (4, SEQ)
    for b, batch in enumerate(batches):
        rows = singles[4 * b : 4 * b + 4]
        assert np.array_equal(batch["input_ids"], np.stack([r["input_ids"] for r in rows]))
        want = [0] + [int(x) + i * SEQ for i, r in enumerate(rows) for x in r["cu_seqlens"][1:]]
        assert batch["cu_seqlens"].tolist() == want


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_a_state_saved_at_any_sequence_resumes_exactly(tmp_path: Path, mode: str) -> None:
    urls = write_docs(tmp_path / "d")
    window = {"window": 3} if mode == "best_fit" else {}
    pack = Pack(SEQ, mode=mode, field="ids", **window)  # type: ignore[arg-type]
    whole = [s["input_ids"].tolist() for s in StreamingDataset(urls, pack=pack, **OPTIONS)]
    assert len(whole) > 20
    for taken in (0, 1, 5, 13, len(whole) - 1, len(whole)):
        ds = StreamingDataset(urls, pack=pack, **OPTIONS)
        it = iter(ds)
        first = [next(it)["input_ids"].tolist() for _ in range(taken)]
        state = ds.state_dict()
        STATE.validate(state)
        held = state.get("pack")
        assert (held is not None) == (0 < taken < len(whole)), (taken, held)
        resumed = StreamingDataset(urls, pack=pack, **OPTIONS)
        resumed.load_state_dict(state)
        assert first + [s["input_ids"].tolist() for s in resumed] == whole, taken


def test_stateful_dataloader_resumes_packed_workers_exactly(tmp_path: Path) -> None:
    urls = write_docs(tmp_path / "d", shards=4)
    pack = Pack(SEQ, mode="best_fit", window=4, field="ids", labels=True)

    def loader() -> StatefulDataLoader:
        ds = StreamingDataset(urls, pack=pack, batch_size=2, **OPTIONS)
        return StatefulDataLoader(ds, batch_size=None, num_workers=2)

    whole = [b["input_ids"].tolist() for b in loader()]
    first_loader = loader()
    it = iter(first_loader)
    first = [next(it)["input_ids"].tolist() for _ in range(7)]
    state = first_loader.state_dict()
    del it
    resumed = loader()
    resumed.load_state_dict(state)
    assert first + [b["input_ids"].tolist() for b in resumed] == whole


def test_the_tokenized_field_is_packed_by_default(tmp_path: Path) -> None:
    words = [f"w{i}" for i in range(40)]
    rng = random.Random(3)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))) for _ in range(30)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    hf = HfTokenizer(models.BPE(unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]", "</s>"])
    )
    tokenizer = Tokenizer.from_str(hf.to_str(), eos="</s>")
    eos = hf.token_to_id("</s>")
    pack = Pack(8, pad_id=-1)
    seqs = list(
        StreamingDataset(str(path), decode={"text": tokenizer}, pack=pack, shuffle_buffer=0)
    )
    flat = [t for s in seqs for t in real_tokens(s, pack)]
    assert flat == [t for text in texts for t in [*hf.encode(text).ids, eos]]


def test_pack_parameters_are_checked_when_made() -> None:
    with pytest.raises(TypeError, match="Pack parameter seq_len"):
        Pack("2048")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Pack parameter seq_len"):
        Pack(0)
    with pytest.raises(ValueError, match="Pack parameter mode"):
        Pack(8, mode="greedy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Pack parameter window"):
        Pack(8, window=4)
    with pytest.raises(ValueError, match="Pack parameter window"):
        Pack(8, mode="best_fit", window=0)
    with pytest.raises(TypeError, match="Pack parameter labels"):
        Pack(8, labels=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="option pack"):
        StreamingDataset("x.jsonl", pack=8)  # type: ignore[arg-type]
    pack = Pack(8, mode="best_fit", window=5, field="ids", labels=True, pad_id=7)
    assert pickle.loads(pickle.dumps(pack)) == pack
    assert (
        repr(pack)
        == 'Pack(seq_len=8, mode="best_fit", window=5, field="ids", labels=True, pad_id=7)'
    )


def test_what_pack_cannot_do_is_refused_by_name(tmp_path: Path) -> None:
    urls = write_docs(tmp_path / "d")
    pack = Pack(SEQ, field="ids")
    with pytest.raises(ValueError, match="option pack: no field is tokenized"):
        StreamingDataset(urls, pack=Pack(SEQ))
    with pytest.raises(ValueError, match=r"option pack: .*--count-tokens ids"):
        StreamingDataset(urls, pack=pack, rank=0, world_size=2, count_samples=True)
    with pytest.raises(ValueError, match="option sample_seed"):
        StreamingDataset(urls, pack=pack, sample_seed=True)
    # It did nothing: packed ranks take equal sequences, not equal documents.
    with pytest.raises(ValueError, match=r"option remainder: .*nothing to pad"):
        StreamingDataset(urls, pack=pack, remainder="pad")
    with pytest.raises(TypeError, match=r"len\(\) is not defined with pack"):
        len(StreamingDataset(urls, pack=pack, count_samples=True))
    with pytest.raises(ValueError, match="mixes packed sequences or samples, not both"):
        Mix([StreamingDataset(urls, pack=pack), StreamingDataset(urls)])
    with pytest.raises(FieldDecodeError, match=r'p-.\.jsonl.*"n".*token ids'):
        list(StreamingDataset(urls, pack=Pack(SEQ, field="n")))


def test_a_damaged_packer_state_is_refused_by_field(tmp_path: Path) -> None:
    urls = write_docs(tmp_path / "d")
    pack = Pack(SEQ, mode="best_fit", window=4, field="ids")
    ds = StreamingDataset(urls, pack=pack, **OPTIONS)
    it = iter(ds)
    for _ in range(6):
        next(it)
    state = ds.state_dict()
    pieces = state["pack"]["open"]
    assert pieces

    def refused(damaged: dict[str, Any], match: str) -> None:
        resumed = StreamingDataset(urls, pack=pack, **OPTIONS)
        resumed.load_state_dict(damaged)
        with pytest.raises(StateMismatchError, match=match):
            next(iter(resumed))

    twice = json.loads(json.dumps(state))
    twice["pack"]["ready"].append(list(pieces[0]))
    refused(twice, r"pack\.(ready|open)\[\d+\]\[\d+\]: it holds tokens .* that another piece holds")
    unread = json.loads(json.dumps(state))
    shard, index = unread["buffer"][0]
    unread["pack"]["open"][0][0] = [shard, index, 0, 1]
    refused(
        unread, r"pack\.open\[0\]\[0\]: sample .* not among the samples the slot has handed out"
    )


def test_a_document_that_cannot_be_packed_fails_and_a_resume_meets_it_again(
    tmp_path: Path,
) -> None:
    urls = write_docs(tmp_path / "d", shards=1)
    lines = Path(urls[0]).read_text().splitlines()
    bad = json.loads(lines[12])
    bad["ids"] = "not ids"
    lines[12] = json.dumps(bad)
    Path(urls[0]).write_text("\n".join(lines) + "\n")
    options = {"seed": 1, "shuffle_buffer": 0}
    pack = Pack(SEQ, field="ids")
    ds = StreamingDataset(urls, pack=pack, **options)
    it = iter(ds)
    taken = 0
    with pytest.raises(FieldDecodeError, match="not token ids"):
        while True:
            next(it)
            taken += 1
    # The stream ends there: no padded sequence of what was left open.
    assert list(it) == []
    state = ds.state_dict()
    resumed = StreamingDataset(urls, pack=pack, **options)
    resumed.load_state_dict(state)
    with pytest.raises(FieldDecodeError, match="not token ids"):
        list(resumed)
    with pytest.raises(ValueError, match="option batch_size"):
        StreamingDataset(urls, pack=Pack(1 << 24, field="ids"), batch_size=200)


def test_a_packed_state_is_refused_by_a_dataset_that_does_not_pack(tmp_path: Path) -> None:
    urls = write_docs(tmp_path / "d")
    ds = StreamingDataset(urls, pack=Pack(SEQ, field="ids"))
    next(iter(ds))
    state = ds.state_dict()
    plain = StreamingDataset(urls)
    plain.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="pack differs"):
        next(iter(plain))


@pytest.mark.parametrize(("mode", "after"), [("concat", 1), ("concat", 3), ("best_fit", 3)])
def test_an_elastic_resume_onto_other_workers_gives_every_token_once(
    tmp_path: Path, mode: str, after: int
) -> None:
    urls = write_docs(tmp_path / "d", shards=4)
    # Elastic resume needs sample counts (local JSON lines: their line breaks).
    options = {**OPTIONS, "count_samples": True}
    docs = [d["ids"] for d in StreamingDataset(urls, **OPTIONS)]
    window = {"window": 3} if mode == "best_fit" else {}
    pack = Pack(SEQ, mode=mode, field="ids", pad_id=-1, **window)  # type: ignore[arg-type]
    seen: list[int] = []
    states = []
    for worker in range(2):
        ds = StreamingDataset(urls, pack=pack, num_workers=2, worker_id=worker, **options)
        it = iter(ds)
        seen += [t for _ in range(3 + worker) for t in real_tokens(next(it), pack)]
        states.append(ds.state_dict())
        assert "pack" in states[-1]
    # The same state twice (as the ranks of a model-parallel group save it)
    # counts once.
    elastic = elastic_state(*states, states[0])
    resumed = []
    for worker in range(after):
        ds = StreamingDataset(urls, pack=pack, num_workers=after, worker_id=worker, **options)
        ds.load_state_dict(elastic)
        resumed.append([s["input_ids"].tolist() for s in ds])
        seen += [t for s in resumed[-1] for t in real_tokens({"input_ids": np.array(s)}, pack)]
    assert sorted(seen) == sorted(t for d in docs for t in d)
    # Each resumed slot's state resumes exactly in its turn.
    ds = StreamingDataset(urls, pack=pack, num_workers=after, worker_id=0, **options)
    ds.load_state_dict(elastic)
    it = iter(ds)
    first = [next(it)["input_ids"].tolist() for _ in range(2)]
    again = StreamingDataset(urls, pack=pack, num_workers=after, worker_id=0, **options)
    again.load_state_dict(ds.state_dict())
    assert first + [s["input_ids"].tolist() for s in again] == resumed[0]


def test_a_packed_run_killed_and_resumed_verifies_each_document_once(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    urls = write_docs(tmp_path / "d", shards=3)
    # Documents with no tokens ride with the sequences too.
    lines = Path(urls[1]).read_text().splitlines()
    for at in (0, 7, 19):
        doc = json.loads(lines[at])
        doc["ids"] = []
        lines[at] = json.dumps(doc)
    Path(urls[1]).write_text("\n".join(lines) + "\n")
    options = {**OPTIONS, "sample_ids": True, "count_samples": True, "batch_size": 2}
    pack = Pack(SEQ, mode="best_fit", window=3, field="ids", labels=True)
    ledger_dir = tmp_path / "ledger"

    def loader(ds: StreamingDataset) -> StatefulDataLoader:
        return StatefulDataLoader(ds, batch_size=None, num_workers=2)

    ds = StreamingDataset(urls, pack=pack, **options)
    first = loader(ds)
    ledger = Ledger(ledger_dir, ds)
    saved = None
    for step, batch in enumerate(first):
        assert batch["__id__"].shape[1:] == (3,)
        ledger.record(batch)
        if step + 1 == 5:
            assert ledger.checkpoint() == 5
            saved = first.state_dict()
        if step + 1 == 8:
            break
    ledger.close()
    assert saved is not None
    ds = StreamingDataset(urls, pack=pack, **options)
    rest = loader(ds)
    rest.load_state_dict(saved)
    with Ledger(ledger_dir, ds, resume_step=5) as resumed:
        assert sum(1 for _ in resumed.track(rest)) > 3
    capfd.readouterr()
    code = run_cli(["shardstream", "verify", str(ledger_dir)])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert "60 of 60 samples" in out and "exactly once" in out, out


def test_a_worker_whose_documents_have_no_tokens_is_accounted_by_verify(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A DataLoader worker whose documents all have no tokens has no
    sequence to carry them (one of padding only would give a loss of no
    tokens): it records them in the ledger's skips file, and verify counts
    them apart, where it reported them as never come."""
    urls = write_docs(tmp_path / "d", shards=3)
    empty = [json.dumps({"n": 1000 + d, "ids": []}) for d in range(20)]
    Path(urls[1]).write_text("\n".join(empty) + "\n")
    options = {**OPTIONS, "sample_ids": True, "count_samples": True}
    pack = Pack(SEQ, field="ids", labels=True)
    ds = StreamingDataset(urls, pack=pack, **options)
    # Each of the three workers streams one shard.
    loader = DataLoader(ds, batch_size=None, num_workers=3)
    ledger_dir = tmp_path / "ledger"
    with Ledger(ledger_dir, ds) as ledger:
        batches = list(ledger.track(loader))
    carried = {(int(s), int(i)) for b in batches for _, s, i in b["__id__"].tolist()}
    assert len(carried) == 40 and all(s != 1 for s, _ in carried), sorted(carried)
    skips = [
        json.loads(line)
        for line in (ledger_dir / "gen-000000" / "rank-00000.skips.jsonl").read_text().splitlines()
    ]
    assert [(s["shard"], s["first"], s["end"], s["cause"]) for s in skips] == [
        (1, 0, 20, "no_tokens")
    ], skips
    capfd.readouterr()
    code = run_cli(["shardstream", "verify", str(ledger_dir)])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert "20 with no tokens left out" in out and "exactly once" in out, out
    assert "(documents with no tokens)" in out, out
    # In the process itself, the warning names them.
    alone = StreamingDataset([urls[1]], pack=pack, **options)
    with pytest.warns(
        SampleSkippedWarning,
        match=r"left out 20 document\(s\) with no tokens \(samples 0 to 20 of shard index 0\)",
    ):
        assert list(alone) == []


def test_the_dataloader_s_own_batches_are_rust_batches_and_verify(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import torch

    urls = write_docs(tmp_path / "d", shards=3)
    pack = Pack(SEQ, field="ids", mode="best_fit", window=3, labels=True)
    options = {**OPTIONS, "sample_ids": True}
    rust = StreamingDataset(urls, pack=pack, batch_size=5, **options)
    ours = StreamingDataset(urls, pack=pack, **options)
    loader = DataLoader(ours, batch_size=5, num_workers=0, collate_fn=collate_sequences)
    ledger_dir = tmp_path / "ledger"
    with Ledger(ledger_dir, ours) as ledger:
        batches = list(ledger.track(loader))
    expected = list(DataLoader(rust, batch_size=None))
    assert len(batches) == len(expected) > 2
    fields = ("input_ids", "labels", "position_ids", "cu_seqlens", "__id__", "__epoch__")
    for got, want in zip(batches, expected, strict=True):
        for field in fields:
            assert got[field].dtype == want[field].dtype, field
            assert torch.equal(got[field], want[field]), field
        assert got["__key__"] == want["__key__"]
        assert list(got) == list(want)
    capfd.readouterr()
    assert run_cli(["shardstream", "verify", str(ledger_dir)]) == 0
    assert "exactly once" in capfd.readouterr().out
    with pytest.raises(ValueError, match="packed sequences"):
        collate_sequences([{"ids": np.arange(3)}])
    with pytest.raises(ValueError, match="not Rust batches"):
        collate_sequences([expected[0]])
    with pytest.raises(ValueError, match=r"widths \[3, 4\]"):
        collate_sequences(
            [
                {"position_ids": np.arange(n), "cu_seqlens": np.array([0, n], dtype=np.int32)}
                for n in (3, 4)
            ]
        )


def test_in_dataloader_workers_every_token_comes_once(tmp_path: Path) -> None:
    urls = write_docs(tmp_path / "d", shards=4)
    docs = [d["ids"] for d in StreamingDataset(urls, **OPTIONS)]
    pack = Pack(SEQ, field="ids", pad_id=-1)
    loader = DataLoader(
        StreamingDataset(urls, pack=pack, **OPTIONS), batch_size=None, num_workers=2
    )
    flat = sorted(t for seq in loader for t in real_tokens(seq, pack))
    assert flat == sorted(t for d in docs for t in d)

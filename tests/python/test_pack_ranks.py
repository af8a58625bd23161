"""Packing across ranks: ``shardstream index --count-tokens`` records each
document's token count in the manifest, and from those every rank's slot of
a worker hands out the same number of sequences (so DDP never waits), no
document twice, through exact and elastic resumes."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from http_server import running_http_server
from test_pack import real_tokens, write_docs
from test_train_lm import corpus
from tokenizers import Tokenizer as HfTokenizer
from torch.utils.data import DataLoader, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from shardstream import (
    Ledger,
    ManifestMismatchError,
    Pack,
    StateMismatchError,
    StreamingDataset,
    Tokenizer,
    elastic_state,
)
from shardstream._core import run_cli

SEQ = 16
OPTIONS = {"seed": 5, "shuffle_buffer": 8, "shuffle_initial": 3, "sample_ids": True}


def indexed_docs(folder: Path, shards: int = 6, docs: int = 30) -> list[str]:
    """Pre-tokenized JSON-lines shards (``write_docs``) and their manifest
    with each document's count of ``ids``."""
    urls = write_docs(folder, shards=shards, docs=docs)
    out = folder / "manifest.json"
    code = run_cli(
        [
            "shardstream",
            "index",
            *urls,
            "-o",
            str(out),
            "--format",
            "jsonl",
            "--count-tokens",
            "ids",
        ]
    )
    assert code == 0
    return urls


def documents(urls: list[str]) -> dict[tuple[int, int], list[int]]:
    """Each document's ids by ``(shard, index)``."""
    return {
        (s, i): json.loads(line)["ids"]
        for s, url in enumerate(urls)
        for i, line in enumerate(Path(url).read_text().splitlines())
    }


def ended(seq: dict[str, Any]) -> list[tuple[int, int]]:
    """The documents whose last token a sequence holds (its ``__id__`` rows)."""
    return [(int(r[1]), int(r[2])) for r in seq["__id__"]]


def rank_sequences(urls: list[str], pack: Pack, world: int, rank: int, workers: int) -> list[dict]:
    ds = StreamingDataset(urls, pack=pack, world_size=world, rank=rank, **OPTIONS)
    return list(DataLoader(ds, batch_size=None, num_workers=workers))


def test_index_counts_the_tokens_the_tokenizer_gives(tmp_path: Path) -> None:
    spec, tok = corpus(tmp_path / "c")
    folder = tmp_path / "c"
    texts = [
        json.loads(line)["text"]
        for shard in range(3)
        for line in (folder / f"part-{shard}.jsonl").read_text().splitlines()
    ]
    hf = HfTokenizer.from_file(tok)
    manifest = folder / "manifest.json"
    argv = ["shardstream", "index", spec, "-o", str(manifest), "--format", "jsonl"]
    assert run_cli([*argv, "--count-tokens", "text", "--tokenizer", tok, "--eos", "</s>"]) == 0
    entries = json.loads(manifest.read_text())["shards"]
    counts = [c for e in entries for c in e["tokens"]["counts"]]
    assert counts == [len(hf.encode(t).ids) + 1 for t in texts]
    for entry in entries:
        assert entry["tokens"]["field"] == "text"
        assert re.fullmatch(
            r"Tokenizer\(digest=0x[0-9a-f]{16}, bos=None, eos=1, add_special_tokens=True\)",
            entry["tokens"]["tokenizer"],
        )
    tokenizer = Tokenizer(tok, eos="</s>")
    pack = Pack(SEQ)
    # The dataset's tokenizer is the one counted with: two ranks plan.
    ds = StreamingDataset(spec, decode={"text": tokenizer}, pack=pack, world_size=2, rank=0)
    assert len(list(ds)) > 0
    # Another tokenizer (no eos) is refused at construction, by name.
    with pytest.raises(ValueError, match=r"option pack: .*counts were made with Tokenizer"):
        StreamingDataset(
            spec, decode={"text": Tokenizer(str(tok))}, pack=pack, world_size=2, rank=0
        )


def test_plan_pack_prints_the_sequences_each_slot_hands_out(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``shardstream plan --pack`` plans as the packed dataset does: with
    two ranks, the sequences per rank it prints are those every rank hands
    out, the slots' documents are every document once; with one rank, each
    slot's ``at least`` is what concatenation packs."""
    urls = indexed_docs(tmp_path / "d")
    total_docs = len(documents(urls))

    def plan(*flags: str) -> tuple[str, list[tuple[int, int, int, int]]]:
        capfd.readouterr()
        argv = ["shardstream", "plan", *urls, "--workers", "2", "--seed", "5", *flags]
        assert run_cli([*argv, "--pack", str(SEQ)]) == 0
        header, *lines = capfd.readouterr().out.splitlines()
        slots = [
            tuple(int(n) for n in m.groups())
            for m in (
                re.match(r"rank (\d+) worker (\d+): \d+ pieces, (\d+) documents, \d+ tokens, "
                         r"(?:at least )?(\d+) sequences", line)
                for line in lines
            )
            if m
        ]  # fmt: skip
        assert len(slots) == (4 if "world_size 2" in header else 2), lines
        return header, slots

    header, slots = plan("--world-size", "2")
    per_rank = int(re.search(r"(\d+) sequences per rank", header)[1])  # type: ignore[index]
    assert sum(s[2] for s in slots) == total_docs
    assert [sum(s[3] for s in slots if s[0] == r) for r in (0, 1)] == [per_rank] * 2
    for rank in (0, 1):
        assert len(rank_sequences(urls, Pack(SEQ, field="ids"), 2, rank, 2)) == per_rank
    header, slots = plan()
    assert "one rank" in header and sum(s[2] for s in slots) == total_docs
    one_rank = rank_sequences(urls, Pack(SEQ, field="ids"), 1, 0, 2)
    assert len(one_rank) == sum(s[3] for s in slots)
    # Without token counts the flag says what to run.
    capfd.readouterr()
    argv = ["shardstream", "plan", *urls, "--no-manifest", "--pack", str(SEQ)]
    assert run_cli(argv) != 0
    err = capfd.readouterr().err
    assert "--pack" in err and "no manifest is in use" in err and "--count-tokens FIELD" in err, err


def worker_tagged(sequence: dict[str, Any]) -> dict[str, Any]:
    """The sequence with the DataLoader worker that made it."""
    info = get_worker_info()
    assert info is not None
    return {**sequence, "worker": info.id}


def test_plan_pack_on_one_rank_plans_remote_shards_as_the_run_does(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """On one rank a run over remote shards deals them whole (their
    ``manifest.json`` beside them is not read to plan); ``plan --pack``
    reads it for the token counts but plans as the run: each worker's
    sequences hold the documents of the shards planned for that worker."""
    urls = indexed_docs(tmp_path / "d")
    with running_http_server(tmp_path / "d") as server:
        remote = [server.url(Path(u).name) for u in urls]
        capfd.readouterr()
        argv = ["shardstream", "plan", *remote, "--workers", "2", "--seed", "5"]
        assert run_cli([*argv, "--pack", str(SEQ)]) == 0
        planned: dict[int, set[int]] = {}
        at_least: dict[int, int] = {}
        for line in capfd.readouterr().out.splitlines():
            if m := re.match(r"rank 0 worker (\d+): .*, at least (\d+) sequences", line):
                worker = int(m[1])
                planned[worker], at_least[worker] = set(), int(m[2])
            elif m := re.match(r"  \S+/p-(\d+)\.jsonl( samples \d+\.\.\d+)?$", line):
                planned[worker].add(int(m[1]))
        assert sorted(planned) == [0, 1] and planned[0] | planned[1] == set(range(len(urls)))
        pack = Pack(SEQ, field="ids")
        ds = StreamingDataset(remote, pack=pack, transform=worker_tagged, **OPTIONS)
        shards: dict[int, set[int]] = {0: set(), 1: set()}
        sequences: Counter[int] = Counter()
        for seq in DataLoader(ds, batch_size=None, num_workers=2):
            sequences[int(seq["worker"])] += 1
            # Token t of document d of shard s is (s * 1000 + d) * 100 + t.
            shards[int(seq["worker"])] |= {t // 100_000 for t in real_tokens(seq, pack)}
    assert shards == planned
    assert all(sequences[w] >= at_least[w] for w in (0, 1)), (sequences, at_least)


@pytest.mark.parametrize(
    ("mode", "lose", "num_workers"),
    [
        ("concat", None, 2),
        ("concat", "shard", 2),
        ("concat", "short", 2),
        ("concat", "shard", None),
        ("best_fit", None, 2),
        ("best_fit", "short", 2),
        ("best_fit", None, None),
    ],
    ids=[
        "whole",
        "a-shard-lost",
        "a-short-document-lost",
        "workers-unknown",
        "best-fit-whole",
        "best-fit-short-document-lost",
        "best-fit-workers-unknown",
    ],
)
def test_verify_replays_what_a_packed_run_across_ranks_left_out(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    mode: str,
    lose: str | None,
    num_workers: int | None,
) -> None:
    """Two ranks pack (2 workers each, a shuffle buffer) and record each
    sequence's documents in a ledger: ``verify`` replays each slot's order
    (its shuffle buffer), plan and packing from the manifest's token
    counts, and checks that the documents no sequence ended are exactly
    those past each worker's planned sequences. Records that lost a
    shard's documents, or only the shortest document handed out (which a
    bound on the remainder lets pass), are a violation; a ledger that does
    not know the worker count is not replayed ("at most once")."""
    urls = indexed_docs(tmp_path / "d")
    ledger_dir = tmp_path / "ledger"
    window = {"window": 4} if mode == "best_fit" else {}
    pack = Pack(SEQ, mode=mode, field="ids", **window)  # type: ignore[arg-type]
    datasets = [
        StreamingDataset(urls, pack=pack, world_size=2, rank=rank, batch_size=2, **OPTIONS)
        for rank in (0, 1)
    ]
    batches = [list(DataLoader(ds, batch_size=None, num_workers=2)) for ds in datasets]
    handed = [(int(r[1]), int(r[2])) for b in batches[0] + batches[1] for r in b["__id__"]]
    docs = documents(urls)
    shortest = min(handed, key=lambda d: (len(docs[d]), d))
    for ds, rank_batches in zip(datasets, batches, strict=True):
        with Ledger(ledger_dir, ds, num_workers=num_workers) as ledger:
            for batch in rank_batches:
                ids = batch["__id__"]
                if lose is not None:
                    shard, index = (3, -1) if lose == "shard" else shortest
                    kept = ids[(ids[:, 1] != shard) | ((index >= 0) & (ids[:, 2] != index))]
                    ids = kept if len(kept) else ids[:1]
                ledger.record({**batch, "__id__": ids})
            ledger.epoch_end(0)
    capfd.readouterr()
    code = run_cli(["shardstream", "verify", str(ledger_dir)])
    out = capfd.readouterr().out
    if num_workers is None:
        assert code == 0 and "sequences past the planned number are left out" in out, out
        assert "ok: no sample twice" in out, out
    elif lose is not None:
        assert code == 1 and "never came" in out, out
        if lose == "short":
            assert f"sample {shortest[1]} of {urls[shortest[0]]}," in out, out
    else:
        assert code == 0, out
        assert "left out past the planned sequences" in out, out
        assert "exactly once" in out and "ok: every sample exactly once" in out, out


def verify_two_ranks(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], spec: Any, **options: Any
) -> tuple[int, str]:
    """Two ranks of ``StreamingDataset(spec, world_size=2, **options)`` read
    by DataLoaders of 2 workers, each batch recorded in one ledger: the exit
    status and output of ``shardstream verify`` on it."""
    ledger_dir = tmp_path / "ledger"
    for rank in (0, 1):
        ds = StreamingDataset(spec, world_size=2, rank=rank, **options)
        with Ledger(ledger_dir, ds, num_workers=2) as ledger:
            for batch in DataLoader(ds, batch_size=None, num_workers=2):
                ledger.record(batch)
            ledger.epoch_end(0)
    capfd.readouterr()
    code = run_cli(["shardstream", "verify", str(ledger_dir)])
    return code, capfd.readouterr().out


def id_rows(batch: dict[str, Any]) -> list[tuple[int, ...]]:
    """A batch's ``__id__`` rows as tuples."""
    return [tuple(int(x) for x in row) for row in batch["__id__"]]


def uninterrupted_ids(make: Callable[[int], Any]) -> set[tuple[int, ...]]:
    """The ``__id__`` rows an uninterrupted epoch of two ranks (``make(rank)``,
    a DataLoader of 2 workers each) hands out."""
    return {
        row
        for rank in (0, 1)
        for batch in DataLoader(make(rank), batch_size=None, num_workers=2)
        for row in id_rows(batch)
    }


def record_a_resumed_run(
    ledger_dir: Path, make: Callable[[int], Any], resume: str, steps_before: int = 4
) -> set[tuple[int, ...]]:
    """Two ranks, each a ``StatefulDataLoader`` of 2 workers over
    ``make(rank)``, record ``steps_before`` steps in a ledger and save their
    state, then 2 steps a crash loses; a new generation resumes from the
    saved states (``"exact"``: each rank its own, ``"elastic"``:
    ``elastic_state`` of both onto the same layout; ``"exact-lost"``: as
    exact, rank 1's first resumed step that ends a document recorded
    without the first) and records the rest of the epoch. Returns the ``__id__``
    rows of the steps that count."""
    states, resume_steps = [], []
    counted: list[tuple[int, ...]] = []
    for rank in (0, 1):
        loader = StatefulDataLoader(make(rank), batch_size=None, num_workers=2)
        with Ledger(ledger_dir, loader.dataset, num_workers=2) as ledger:
            it = iter(loader)
            for _ in range(steps_before):
                batch = next(it)
                counted += id_rows(batch)
                ledger.record(batch)
            resume_steps.append(ledger.checkpoint())
            states.append(loader.state_dict())
            for _ in range(2):
                ledger.record(next(it))
            del it
    elastic = elastic_state(*states) if resume == "elastic" else None
    for rank in (0, 1):
        dataset = make(rank)
        if elastic is not None:
            dataset.load_state_dict(elastic)
        loader = StatefulDataLoader(dataset, batch_size=None, num_workers=2)
        if elastic is None:
            loader.load_state_dict(states[rank])
        with Ledger(ledger_dir, dataset, resume_step=resume_steps[rank], num_workers=2) as ledger:
            lose = resume == "exact-lost" and rank == 1
            for batch in loader:
                if lose and len(batch["__id__"]):
                    batch, lose = {**batch, "__id__": batch["__id__"][1:]}, False
                counted += id_rows(batch)
                ledger.record(batch)
            ledger.epoch_end(0)
    assert len(set(counted)) == len(counted)
    return set(counted)


def check_resumed_verdict(
    out: str, code: int, counted: set[tuple[int, ...]], whole: set[tuple[int, ...]]
) -> bool:
    """Checks verify's report of a resumed packed epoch against the truth:
    exactly once where the documents the counted steps ended are those an
    uninterrupted run ends, else at most once saying why. Returns whether
    they are."""
    assert code == 0 and "generations 0,1" in out, out
    if counted == whole:
        assert ": exactly once" in out and "ok: every sample exactly once" in out, out
        assert "left out past the planned sequences" in out, out
    else:
        assert ": at most once (" in out and "ok: no sample twice" in out, out
        assert "its records are not the uninterrupted plan's" in out, out
    return counted == whole


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
@pytest.mark.parametrize("resume", ["exact", "elastic", "exact-lost"])
def test_verify_replays_a_packed_epoch_resumed_within_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], mode: str, resume: str
) -> None:
    """A packed run across two ranks of two workers, killed after a
    checkpoint and resumed in a new generation. Verify replays the records
    that count (the crashed steps superseded) as one uninterrupted run's:
    an exact resume continues the plan, so its epoch is proved exactly
    once. An elastic resume plans the rest anew even onto the same layout,
    and records that lost a document after the resume are not the plan's
    either: verify's verdict must match the truth (at most once, saying
    why, where the documents recorded are not the uninterrupted run's)."""
    urls = indexed_docs(tmp_path / "d")
    window = {"window": 4} if mode == "best_fit" else {}
    pack = Pack(SEQ, mode=mode, field="ids", **window)  # type: ignore[arg-type]
    ledger_dir = tmp_path / "ledger"

    def make(rank: int) -> StreamingDataset:
        return StreamingDataset(urls, pack=pack, world_size=2, rank=rank, batch_size=2, **OPTIONS)

    counted = record_a_resumed_run(ledger_dir, make, resume)
    whole = uninterrupted_ids(make)
    capfd.readouterr()
    code = run_cli(["shardstream", "verify", str(ledger_dir)])
    same = check_resumed_verdict(capfd.readouterr().out, code, counted, whole)
    if resume != "elastic":
        assert same == (resume == "exact")


def test_verify_says_why_a_packed_order_was_not_replayed(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A shuffle buffer whose byte bound its documents may pass lets one
    out early, which the plan alone cannot replay: verify checks what each
    worker left out within its remainder and says why the order was not
    replayed."""
    urls = indexed_docs(tmp_path / "d")
    options = {**OPTIONS, "shuffle_buffer_bytes": 64}
    pack = Pack(SEQ, field="ids")
    code, out = verify_two_ranks(tmp_path, capfd, urls, pack=pack, batch_size=2, **options)
    assert code == 0, out
    assert "left out are within its remainder" in out, out
    assert "was not replayed" in out and "may pass shuffle_buffer_bytes" in out, out


def test_verify_proves_a_tokenized_run_across_ranks_exactly_once(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Text tokenized while streaming (the counted field's ``Tokenizer``,
    the default shuffle buffer) and packed across two ranks of two workers:
    each held document's bytes are bounded by its span and its token count,
    so verify replays each slot's order and proves the epoch exactly once."""
    spec, tok = corpus(tmp_path / "c")
    manifest = tmp_path / "c" / "manifest.json"
    argv = ["shardstream", "index", spec, "-o", str(manifest), "--format", "jsonl"]
    assert run_cli([*argv, "--count-tokens", "text", "--tokenizer", tok, "--eos", "</s>"]) == 0
    decode = {"text": Tokenizer(tok, eos="</s>")}
    options = {"pack": Pack(SEQ), "batch_size": 4, "seed": 3, "sample_ids": True}
    code, out = verify_two_ranks(tmp_path, capfd, spec, decode=decode, **options)
    assert code == 0, out
    assert "left out past the planned sequences" in out, out
    assert ": exactly once" in out and "ok: every sample exactly once" in out, out


PIECE = re.compile(r"    (\S+) sample (\d+) tokens (\d+)\.\.(\d+) of (\d+)")


def explained_sequences(
    out: str, urls: list[str], docs: dict[tuple[int, int], list[int]]
) -> tuple[str, list[list[int]]]:
    """The header of ``explain --pack``'s answer, and the tokens of each
    sequence it names (each piece read from the documents)."""
    header, *lines = out.splitlines()
    named: list[list[int]] = []
    for line in lines:
        if line.startswith("  sequence "):
            named.append([])
            continue
        m = PIECE.fullmatch(line)
        assert m, line
        doc = docs[(urls.index(m[1]), int(m[2]))]
        assert int(m[5]) == len(doc)
        named[-1].extend(doc[int(m[3]) : int(m[4])])
    return header, named


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
@pytest.mark.parametrize("world", [1, 2])
def test_explain_pack_names_the_tokens_each_sequence_of_a_step_holds(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], mode: str, world: int
) -> None:
    """``shardstream explain --pack`` replays each worker's shuffle buffer
    and packer from the manifest's token counts: the pieces it names for
    every step's sequences are the tokens those sequences hold (each token
    of the test documents names its document and place), on one rank and
    across two."""
    urls = indexed_docs(tmp_path / "d")
    docs = documents(urls)
    best_fit = mode == "best_fit"
    window = ["--pack-window", "4"] if best_fit else []
    pack = Pack(SEQ, mode=mode, field="ids", pad_id=-1, **({"window": 4} if best_fit else {}))  # type: ignore[arg-type]
    rank = world - 1
    ds = StreamingDataset(urls, pack=pack, world_size=world, rank=rank, batch_size=3, **OPTIONS)
    batches = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert len(batches) > 5
    argv = ["shardstream", "explain", *urls, "--batch-size", "3", "--rank", str(rank)]
    argv += ["--world-size", str(world), "--num-workers", "2", "--seed", "5"]
    argv += ["--shuffle-buffer", "8", "--shuffle-initial", "3", "--format", "jsonl"]
    argv += ["--pack", str(SEQ), "--pack-field", "ids", "--pack-mode", mode, *window]
    for step, batch in enumerate(batches):
        capfd.readouterr()
        assert run_cli([*argv, "--step", str(step)]) == 0
        header, named = explained_sequences(capfd.readouterr().out, urls, docs)
        assert (
            f"step {step}: worker " in header and f"{len(batch['input_ids'])} sequences" in header
        )
        real = [[int(t) for t in row if t != -1] for row in batch["input_ids"]]
        assert named == real, step
    assert run_cli([*argv, "--step", str(len(batches))]) != 0
    assert f"takes {len(batches)} steps" in capfd.readouterr().err
    if not best_fit:
        # A window is best fit's: refused with concatenation, by name.
        assert run_cli([*argv, "--step", "0", "--pack-window", "4"]) != 0
        assert "--pack-window" in capfd.readouterr().err


@pytest.mark.parametrize(
    ("mode", "world", "workers"),
    [
        ("concat", 1, 2),
        ("best_fit", 1, 2),
        ("concat", 2, 2),
        ("best_fit", 2, 2),
        ("best_fit", 2, 0),
    ],
)
def test_explain_pack_from_a_saved_state_names_the_sequences_of_the_resumed_run(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], mode: str, world: int, workers: int
) -> None:
    """``shardstream explain --pack --state``: a ``StatefulDataLoader`` of 2
    workers (or none) over a packed rank, saved after 5 batches (its packers
    holding ready or open sequences); each step of the run resumed from that state
    holds the tokens explain names from the state alone (each worker's
    place found from the documents its packer took and held), and no step
    is past the rest. A state of another seed's plan is named."""
    urls = indexed_docs(tmp_path / "d")
    docs = documents(urls)
    best_fit = mode == "best_fit"
    window = {"window": 4} if best_fit else {}
    pack = Pack(SEQ, mode=mode, field="ids", pad_id=-1, **window)  # type: ignore[arg-type]
    rank = world - 1

    def loader() -> StatefulDataLoader:
        ds = StreamingDataset(urls, pack=pack, world_size=world, rank=rank, batch_size=3, **OPTIONS)
        return StatefulDataLoader(ds, batch_size=None, num_workers=workers)

    first = loader()
    iterator = iter(first)
    for _ in range(5):
        next(iterator)
    state = first.state_dict()
    del iterator
    saved = tmp_path / "state.json"
    saved.write_text(json.dumps(state))
    # Its packers hold sequences (ready or open) that the resume goes on with.
    assert re.search(r'"(ready|open)": \[\[', saved.read_text()), saved.read_text()
    resumed = loader()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) > 3

    def explain(seed: int) -> list[str]:
        argv = ["shardstream", "explain", *urls, "--batch-size", "3", "--rank", str(rank)]
        argv += ["--state", str(saved), "--seed", str(seed), "--format", "jsonl"]
        argv += ["--shuffle-buffer", "8", "--shuffle-initial", "3"]
        argv += ["--pack", str(SEQ), "--pack-field", "ids", "--pack-mode", mode]
        return argv + (["--pack-window", "4"] if best_fit else [])

    argv = explain(5)
    for step, batch in enumerate(rest):
        capfd.readouterr()
        assert run_cli([*argv, "--step", str(step)]) == 0, capfd.readouterr().err
        header, named = explained_sequences(capfd.readouterr().out, urls, docs)
        assert f"step {step} after the resume: worker " in header, header
        real = [[int(t) for t in row if t != -1] for row in batch["input_ids"]]
        assert named == real, step
    assert run_cli([*argv, "--step", str(len(rest))]) == 1
    assert f"takes {len(rest)} steps in epoch 0 after the resume" in capfd.readouterr().err
    # Another seed's order did not pack the state's documents: named.
    assert run_cli([*explain(6), "--step", "0"]) == 1
    assert "are not those of its slot in this plan" in capfd.readouterr().err
    # The state of a packed stream needs --pack.
    unpacked = argv[: argv.index("--pack")]
    assert run_cli([*unpacked, "--step", "0"]) == 1
    assert "give --pack SEQ_LEN" in capfd.readouterr().err


def test_packing_across_ranks_without_token_counts_is_refused_at_construction(
    tmp_path: Path,
) -> None:
    urls = write_docs(tmp_path / "d")
    with pytest.raises(ValueError, match=r"option pack: .*--count-tokens ids"):
        StreamingDataset(
            urls, pack=Pack(SEQ, field="ids"), world_size=2, rank=1, count_samples=True
        )
    # One rank needs none.
    assert len(list(StreamingDataset(urls, pack=Pack(SEQ, field="ids")))) > 0


@pytest.mark.parametrize(
    ("mode", "world", "workers"), [("concat", 2, 2), ("best_fit", 3, 1), ("best_fit", 2, 2)]
)
def test_every_rank_hands_out_as_many_sequences_and_no_document_twice(
    tmp_path: Path, mode: str, world: int, workers: int
) -> None:
    urls = indexed_docs(tmp_path / "d")
    docs = documents(urls)
    window = {"window": 4} if mode == "best_fit" else {}
    pack = Pack(SEQ, mode=mode, field="ids", pad_id=-1, **window)  # type: ignore[arg-type]
    ranks = [rank_sequences(urls, pack, world, rank, workers) for rank in range(world)]
    lengths = [len(seqs) for seqs in ranks]

    assert len(set(lengths)) == 1 and lengths[0] > 10, lengths
    seen = Counter(doc for seqs in ranks for seq in seqs for doc in ended(seq))
    assert max(seen.values()) == 1
    # Each sequence names its epoch, for a step in which no document ends.
    assert {int(seq["__epoch__"][0]) for seqs in ranks for seq in seqs} == {0}
    tokens = Counter(t for seqs in ranks for seq in seqs for t in real_tokens(seq, pack))
    assert max(tokens.values()) == 1
    # Each token handed out is a document's, and each document seen is whole.
    every = {t for ids in docs.values() for t in ids}
    assert set(tokens) <= every
    for doc in seen:
        assert all(t in tokens for t in docs[doc]), doc
    # The plan cuts each slot near-equal tokens (within a document's), so
    # what the slots' equal sequence counts leave out is a few sequences
    # per slot: the difference, the last partial sequence and, under best
    # fit, the open ones.
    longest = max(map(len, docs.values()))
    per_slot = 2 * longest + (2 + window.get("window", 0)) * (SEQ + 1)
    assert len(every) - len(tokens) <= world * workers * per_slot


def test_ranks_resume_exactly_in_stateful_dataloaders(tmp_path: Path) -> None:
    urls = indexed_docs(tmp_path / "d")
    pack = Pack(SEQ, mode="best_fit", window=3, field="ids", labels=True)

    def loader(rank: int) -> StatefulDataLoader:
        ds = StreamingDataset(urls, pack=pack, world_size=2, rank=rank, batch_size=2, **OPTIONS)
        return StatefulDataLoader(ds, batch_size=None, num_workers=2)

    for rank in range(2):
        whole = [b["input_ids"].tolist() for b in loader(rank)]
        first_loader = loader(rank)
        it = iter(first_loader)
        first = [next(it)["input_ids"].tolist() for _ in range(5)]
        state = first_loader.state_dict()
        del it
        resumed = loader(rank)
        resumed.load_state_dict(state)
        assert first + [b["input_ids"].tolist() for b in resumed] == whole


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_an_elastic_resume_onto_more_ranks_gives_equal_steps_and_no_document_twice(
    tmp_path: Path, mode: str
) -> None:
    urls = indexed_docs(tmp_path / "d")
    docs = documents(urls)
    window = {"window": 3} if mode == "best_fit" else {}
    pack = Pack(SEQ, mode=mode, field="ids", pad_id=-1, **window)  # type: ignore[arg-type]
    seen: list[tuple[int, int]] = []
    tokens: list[int] = []
    states = []
    for rank in range(2):
        ds = StreamingDataset(urls, pack=pack, world_size=2, rank=rank, **OPTIONS)
        it = iter(ds)
        for _ in range(7):
            seq = next(it)
            seen += ended(seq)
            tokens += real_tokens(seq, pack)
        state = ds.state_dict()
        assert isinstance(state["sequences_left"], int) and state["sequences_left"] > 0
        states.append(state)
    elastic = elastic_state(*states)
    lengths = []
    for rank in range(3):
        ds = StreamingDataset(urls, pack=pack, world_size=3, rank=rank, **OPTIONS)
        ds.load_state_dict(elastic)
        rest = list(ds)
        lengths.append(len(rest))
        for seq in rest:
            seen += ended(seq)
            tokens += real_tokens(seq, pack)
    assert len(set(lengths)) == 1 and lengths[0] > 3, lengths
    assert max(Counter(seen).values()) == 1
    assert max(Counter(tokens).values()) == 1
    assert set(tokens) <= {t for ids in docs.values() for t in ids}


def test_a_slot_that_handed_out_its_sequences_resumes_to_its_end(tmp_path: Path) -> None:
    urls = indexed_docs(tmp_path / "d", shards=4)
    pack = Pack(SEQ, field="ids")
    ds = StreamingDataset(urls, pack=pack, world_size=2, rank=1, **OPTIONS)
    whole = list(ds)
    state = ds.state_dict()
    # Finished: the epoch moves on, and an elastic resume takes nothing of
    # this slot (what it left out stays out, as in an exact resume).
    assert state["sequences_left"] == 0 and state["finished"] and "pack" not in state
    again = StreamingDataset(urls, pack=pack, world_size=2, rank=1, **OPTIONS)
    again.load_state_dict(state)
    assert list(again) == [] and len(whole) > 0


def test_a_damaged_sequences_left_is_refused_by_name(tmp_path: Path) -> None:
    urls = indexed_docs(tmp_path / "d", shards=4)
    pack = Pack(SEQ, field="ids")
    ds = StreamingDataset(urls, pack=pack, world_size=2, rank=0, **OPTIONS)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    planned = state["sequences_left"] + 1
    for damage, message in [
        (
            {"sequences_left": planned + 1},
            rf"sequences_left: {planned + 1}, more than the {planned}",
        ),
        ({"finished": True}, r"field finished: true, yet sequences_left is"),
    ]:
        resumed = StreamingDataset(urls, pack=pack, world_size=2, rank=0, **OPTIONS)
        resumed.load_state_dict({**state, **damage})
        with pytest.raises(StateMismatchError, match=message):
            next(iter(resumed))
    # On one rank a packed stream plans no sequences.
    one = StreamingDataset(urls, pack=pack, **OPTIONS)
    one_state = {**one.state_dict(), "sequences_left": 3}
    resumed = StreamingDataset(urls, pack=pack, **OPTIONS)
    resumed.load_state_dict(one_state)
    with pytest.raises(
        StateMismatchError, match=r"sequences_left: set, but the stream plans no sequences"
    ):
        next(iter(resumed))


def test_a_count_the_documents_do_not_have_is_an_error_naming_the_sample(tmp_path: Path) -> None:
    urls = indexed_docs(tmp_path / "d", shards=2)
    manifest = tmp_path / "d" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["shards"][1]["tokens"]["counts"][4] += 1
    manifest.write_text(json.dumps(data))
    ds = StreamingDataset(urls, pack=Pack(SEQ, field="ids"), world_size=2, rank=0, **OPTIONS)
    other = StreamingDataset(urls, pack=Pack(SEQ, field="ids"), world_size=2, rank=1, **OPTIONS)
    with pytest.raises(
        ManifestMismatchError, match=r"p-1\.jsonl.*sample 4 .*manifest's token counts"
    ):
        list(ds)
        list(other)


def test_a_rank_whose_documents_are_skipped_fills_up_with_padding(tmp_path: Path) -> None:
    urls = indexed_docs(tmp_path / "d", shards=4)
    # Damage a line of one shard after indexing, keeping its size and its
    # modification time (the manifest still describes it).
    path = Path(urls[2])
    stat = path.stat()
    text = path.read_text()
    cut = text.index("\n", len(text) // 3) + 1
    path.write_text(text[:cut] + "!" + text[cut + 1 :])
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    pack = Pack(SEQ, field="ids", labels=True)
    options = {**OPTIONS, "on_error": "warn"}
    ranks = []
    with pytest.warns(Warning):
        for rank in range(2):
            ds = StreamingDataset(urls, pack=pack, world_size=2, rank=rank, **options)
            ranks.append(list(ds))
    assert len(ranks[0]) == len(ranks[1]) > 0
    padding = [seq for seqs in ranks for seq in seqs if seq["__key__"] == "padding"]
    assert padding, "the rank that lost documents fills up"
    for seq in padding:
        assert (seq["labels"] == -100).all() and len(seq["__id__"]) == 0


def test_index_counting_options_are_checked_by_name(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    urls = write_docs(tmp_path / "d", shards=1)
    argv = ["shardstream", "index", *urls, "-o", str(tmp_path / "m.json"), "--format", "jsonl"]
    capfd.readouterr()
    missing = str(tmp_path / "missing.json")
    assert run_cli([*argv, "--count-tokens", "ids", "--tokenizer", missing]) != 0
    err = capfd.readouterr().err
    assert "--tokenizer" in err and "missing.json" in err, err
    # --bos and --eos belong to a tokenizer.
    assert run_cli([*argv, "--count-tokens", "ids", "--bos", "1"]) != 0
    assert "--tokenizer" in capfd.readouterr().err
    # A field that is not token ids names the shard, the document and the field.
    assert run_cli([*argv, "--count-tokens", "n"]) != 0
    err = capfd.readouterr().err
    assert re.search(r'p-0\.jsonl.*"n".*token ids', err), err
    assert not (tmp_path / "m.json").exists()


def test_ranks_are_cut_equal_tokens_not_equal_documents(tmp_path: Path) -> None:
    # One shard of long documents, one of short ones: cut by documents, one
    # rank would get the long ones and the other the short ones, and equal
    # steps would leave most of the long ones out.
    folder = tmp_path / "d"
    folder.mkdir()
    urls = []
    for s, length in enumerate((40, 2)):
        lines = [
            json.dumps({"ids": [s * 10**5 + d * 100 + t for t in range(length)]}) for d in range(30)
        ]
        (folder / f"p-{s}.jsonl").write_text("\n".join(lines) + "\n")
        urls.append(str(folder / f"p-{s}.jsonl"))
    argv = ["shardstream", "index", *urls, "-o", str(folder / "manifest.json"), "--format", "jsonl"]
    assert run_cli([*argv, "--count-tokens", "ids"]) == 0
    pack = Pack(SEQ, field="ids", pad_id=-1)
    ranks = [rank_sequences(urls, pack, 2, rank, 1) for rank in range(2)]
    assert len(ranks[0]) == len(ranks[1])
    with pytest.raises(TypeError, match=r"num_samples\(\) is not defined with pack on several"):
        StreamingDataset(urls, pack=pack, world_size=2, rank=0).num_samples()
    handed = sum(len(real_tokens(seq, pack)) for seqs in ranks for seq in seqs)
    assert handed >= 0.95 * (30 * 40 + 30 * 2), handed


def test_a_state_is_of_the_token_counts_it_was_planned_with(tmp_path: Path) -> None:
    urls = indexed_docs(tmp_path / "d", shards=2)
    pack = Pack(SEQ, field="ids")
    ds = StreamingDataset(urls, pack=pack, world_size=2, rank=0, **OPTIONS)
    next(iter(ds))
    state = ds.state_dict()
    manifest = tmp_path / "d" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["shards"][0]["tokens"]["counts"][0] += 1
    manifest.write_text(json.dumps(data))
    resumed = StreamingDataset(urls, pack=pack, world_size=2, rank=0, **OPTIONS)
    resumed.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="token_counts"):
        next(iter(resumed))


@pytest.mark.parametrize("workers", [0, 3])
def test_ranks_resume_from_before_the_first_batch_and_after_the_epoch(
    tmp_path: Path, workers: int
) -> None:
    urls = indexed_docs(tmp_path / "d")
    pack = Pack(SEQ, field="ids")
    for rank in range(2):

        def loader(rank: int = rank) -> StatefulDataLoader:
            # Rust batches of 3: a worker's sequences do not divide into them.
            ds = StreamingDataset(urls, pack=pack, world_size=2, rank=rank, batch_size=3, **OPTIONS)
            return StatefulDataLoader(ds, batch_size=None, num_workers=workers)

        whole = [b["input_ids"].tolist() for b in loader()]
        before = loader()
        state = before.state_dict()
        resumed = loader()
        resumed.load_state_dict(state)
        assert [b["input_ids"].tolist() for b in resumed] == whole, rank
        ended = loader()
        assert len(list(ended)) == len(whole)
        state = ended.state_dict()
        resumed = loader()
        resumed.load_state_dict(state)
        # The next epoch, as long (every rank hands out as many again).
        assert len(list(resumed)) == len(whole) > 10


def parquet_corpus(root: Path) -> tuple[str, str, list[str]]:
    """``corpus``'s documents as three Parquet files of 3 row groups each
    (10 rows a group), the manifest beside them recording each row's token
    count (``--format parquet``); the spec, the tokenizer and the texts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    spec, tok = corpus(root / "text")
    texts = [
        json.loads(line)["text"]
        for shard in range(3)
        for line in (root / "text" / f"part-{shard}.jsonl").read_text().splitlines()
    ]
    folder = root / "parquet"
    folder.mkdir()
    for f in range(3):
        rows = texts[30 * f : 30 * (f + 1)]
        table = pa.table({"text": rows, "n": list(range(30 * f, 30 * (f + 1)))})
        pq.write_table(table, folder / f"docs-{f}.parquet", row_group_size=10)
    spec = str(folder / "docs-{0..2}.parquet")
    argv = ["shardstream", "index", spec, "-o", str(folder / "manifest.json")]
    argv += ["--format", "parquet", "--count-tokens", "text", "--tokenizer", tok, "--eos", "</s>"]
    assert run_cli(argv) == 0
    return spec, tok, texts


def test_parquet_text_packs_across_ranks_from_the_manifests_token_counts(tmp_path: Path) -> None:
    spec, tok, texts = parquet_corpus(tmp_path)
    folder = tmp_path / "parquet"
    manifest = json.loads((folder / "manifest.json").read_text())
    hf = HfTokenizer.from_file(tok)
    assert [e["row_groups"] for e in manifest["shards"]] == [[10, 10, 10]] * 3
    assert [e["offsets"] for e in manifest["shards"]] == [[]] * 3
    counts = [c for e in manifest["shards"] for c in e["tokens"]["counts"]]
    assert counts == [len(hf.encode(t).ids) + 1 for t in texts]

    decode = {"text": Tokenizer(tok, eos="</s>")}
    pack = Pack(SEQ, mode="best_fit", window=3, pad_id=-1)
    world, workers = 2, 2
    ranks = []
    for rank in range(world):
        ds = StreamingDataset(
            spec, decode=decode, pack=pack, world_size=world, rank=rank, **OPTIONS
        )
        ranks.append(list(DataLoader(ds, batch_size=None, num_workers=workers)))
    lengths = [len(seqs) for seqs in ranks]
    assert len(set(lengths)) == 1 and lengths[0] > 20, lengths
    seen = Counter(doc for seqs in ranks for seq in seqs for doc in ended(seq))
    assert max(seen.values()) == 1
    # Most documents come (what the equal sequence counts leave out is a
    # few sequences per slot).
    assert len(seen) >= len(texts) - world * workers * 4, len(seen)

    # Without the manifest (or with it beside other files) packing across
    # ranks is refused at construction, naming the command.
    with pytest.raises(ValueError, match=r"--format parquet --count-tokens text"):
        StreamingDataset(
            spec, decode=decode, pack=pack, world_size=2, rank=0, manifest=False, **OPTIONS
        )
    # A file rewritten since it was indexed is named at construction.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts[:30], "n": list(range(30))}), folder / "docs-1.parquet")
    with pytest.raises(ManifestMismatchError, match=r"docs-1\.parquet"):
        StreamingDataset(spec, decode=decode, pack=pack, world_size=2, rank=0, **OPTIONS)


def test_index_refuses_parquet_without_token_counts(tmp_path: Path, capfd) -> None:
    spec, _, _ = parquet_corpus(tmp_path)
    out = str(tmp_path / "m.json")
    capfd.readouterr()
    assert run_cli(["shardstream", "index", spec, "-o", out, "--format", "parquet"]) != 0
    assert "--count-tokens" in capfd.readouterr().err
    assert run_cli(["shardstream", "index", spec, "-o", out]) != 0
    assert "--format parquet --count-tokens FIELD" in capfd.readouterr().err


def test_parquet_ranks_resume_exactly_in_spawned_workers(tmp_path: Path) -> None:
    """The row groups' token counts travel with the dataset to spawned
    DataLoader workers (the encoded shard list), and a state saved there
    resumes exactly."""
    spec, tok, _ = parquet_corpus(tmp_path)
    decode = {"text": Tokenizer(tok, eos="</s>")}
    pack = Pack(SEQ, pad_id=-1)

    def loader() -> StatefulDataLoader:
        ds = StreamingDataset(
            spec, decode=decode, pack=pack, world_size=2, rank=1, batch_size=2, **OPTIONS
        )
        return StatefulDataLoader(
            ds, batch_size=None, num_workers=2, multiprocessing_context="spawn", timeout=120
        )

    whole = [b["input_ids"].tolist() for b in loader()]
    first_loader = loader()
    it = iter(first_loader)
    first = [next(it)["input_ids"].tolist() for _ in range(3)]
    state = first_loader.state_dict()
    del it
    resumed = loader()
    resumed.load_state_dict(state)
    assert first + [b["input_ids"].tolist() for b in resumed] == whole


def test_index_describes_a_parquet_file_with_no_rows(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"ids": pa.array([], pa.list_(pa.int32()))}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"ids": [[1, 2, 3], [4]]}), tmp_path / "b.parquet")
    spec = str(tmp_path / "{a,b}.parquet")
    out = tmp_path / "manifest.json"
    argv = ["shardstream", "index", spec, "-o", str(out), "--format", "parquet"]
    assert run_cli([*argv, "--count-tokens", "ids"]) == 0
    entries = {Path(e["url"]).name: e for e in json.loads(out.read_text())["shards"]}
    assert entries["a.parquet"]["samples"] == 0 and entries["a.parquet"]["tokens"]["counts"] == []
    assert entries["b.parquet"]["tokens"]["counts"] == [3, 1]
    ds = StreamingDataset(spec, pack=Pack(4, field="ids"), world_size=2, rank=0)
    assert len(list(ds)) >= 0


def test_a_manifest_of_other_shards_beside_parquet_files_is_not_theirs(tmp_path: Path) -> None:
    """A shardstream manifest of tar shards in the folder of Parquet files
    (which it does not describe) is passed over, as before Parquet entries
    existed: the Parquet dataset reads without it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    urls = indexed_docs(tmp_path, shards=2, docs=5)
    assert (tmp_path / "manifest.json").exists() and urls
    pq.write_table(pa.table({"ids": [[1, 2], [3]]}), tmp_path / "d.parquet")
    rows = list(StreamingDataset(str(tmp_path / "d.parquet")))
    assert [list(r["ids"]) for r in rows] == [[1, 2], [3]]


def test_another_rank_checks_its_copies_of_parquet_files_by_their_size(tmp_path: Path) -> None:
    """Rank 0's resolution of local Parquet files (row groups, each of its
    span's size) checked by another rank against its copies: the whole
    file's size and time, so an identical copy passes and another fails."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardstream.job_resolution import _decoded, _encoded

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"a": list(range(100))}), path, row_group_size=30)
    ds = StreamingDataset(str(path))
    copy = _decoded(_encoded(ds.shard_list), ds.options)
    copy.check_local_files()
    pq.write_table(pa.table({"a": list(range(300))}), path, row_group_size=30)
    with pytest.raises(ManifestMismatchError, match=r"rows\.parquet"):
        copy.check_local_files()


@pytest.mark.usefixtures("s3_credentials")
@pytest.mark.parametrize("named", [True, False])
def test_parquet_on_s3_packs_across_ranks_from_its_manifest(
    s3, tmp_path: Path, named: bool
) -> None:
    """Parquet files on S3 (moto), indexed there with token counts, the
    manifest written beside them and named by URL, or found there: two
    ranks hand out as many sequences, no document twice; a replaced object
    is named by its ETag when the dataset is made."""
    from s3_server import s3_config

    _, tok, texts = parquet_corpus(tmp_path)
    client = s3.client()
    bucket = "named" if named else "found"
    client.create_bucket(Bucket=bucket)
    for f in range(3):
        client.upload_file(
            str(tmp_path / "parquet" / f"docs-{f}.parquet"), bucket, f"pq/{f}.parquet"
        )
    flags = ["--s3-endpoint-url", s3.endpoint_url, "--s3-path-style", "--s3-region", "us-east-1"]
    spec = f"s3://{bucket}/pq/"
    manifest = f"{spec}manifest.json"
    argv = ["shardstream", *flags, "index", spec, "-o", manifest, "--format", "parquet"]
    assert run_cli([*argv, "--count-tokens", "text", "--tokenizer", tok, "--eos", "</s>"]) == 0

    options = {
        "decode": {"text": Tokenizer(tok, eos="</s>")},
        "pack": Pack(SEQ, pad_id=-1),
        "s3": s3_config(s3),
        "world_size": 2,
        **OPTIONS,
    }
    if named:
        options["manifest"] = manifest
    assert StreamingDataset(spec, rank=0, **options).manifest_path == manifest
    ranks = [list(StreamingDataset(spec, rank=r, **options)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) > 20
    seen = Counter(doc for seqs in ranks for seq in seqs for doc in ended(seq))
    assert max(seen.values()) == 1 and len(seen) >= len(texts) - 2 * 4
    client.upload_file(str(tmp_path / "parquet" / "docs-0.parquet"), bucket, "pq/1.parquet")
    with pytest.raises(ManifestMismatchError, match=r"pq/1\.parquet.*ETag"):
        StreamingDataset(spec, rank=0, **options)

"""A ``Mix`` of packed streams: it mixes their sequences (every one
``seq_len + 1`` tokens, so its weights are token weights), each stream's
sequences planned from the manifest's token counts on one rank too, with
exact and elastic resume, the mixture's ids in ``__id__`` and ``verify``."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from test_pack import real_tokens, write_docs
from test_pack_ranks import check_resumed_verdict, record_a_resumed_run, uninterrupted_ids
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from shardstream import Ledger, Mix, Pack, StreamingDataset, elastic_state
from shardstream._core import mix_counts, run_cli

SEQ = 16
OPTIONS = {"seed": 5, "shuffle_buffer": 8, "shuffle_initial": 3, "sample_ids": True}
# Stream b's token ids start here, so that a token names its stream.
OFFSET = 10**8


def indexed(folder: Path, shards: int, offset: int, docs: int = 20) -> list[str]:
    """``write_docs`` shards of ``docs`` documents (their ids moved by
    ``offset``) and their manifest with each document's count of ``ids``."""
    urls = write_docs(folder, shards=shards, docs=docs, seed=offset % 7)
    for url in urls:
        docs = [json.loads(line) for line in Path(url).read_text().splitlines()]
        lines = [json.dumps({**d, "ids": [t + offset for t in d["ids"]]}) for d in docs]
        Path(url).write_text("\n".join(lines) + "\n")
    argv = ["shardstream", "index", *urls, "-o", str(folder / "manifest.json")]
    assert run_cli([*argv, "--format", "jsonl", "--count-tokens", "ids"]) == 0
    return urls


@pytest.fixture
def corpora(tmp_path: Path) -> tuple[list[str], list[str]]:
    return indexed(tmp_path / "a", 4, 0), indexed(tmp_path / "b", 3, OFFSET)


def tokens_of(urls: list[str]) -> list[int]:
    return sorted(
        t
        for u in urls
        for line in Path(u).read_text().splitlines()
        for t in json.loads(line)["ids"]
    )


def mixture(
    corpora: tuple[list[str], list[str]],
    packs: tuple[Pack, Pack],
    weights: list[float],
    policy: str = "stop",
    **layout: Any,
) -> Mix:
    streams = [
        StreamingDataset(urls, pack=pack, **OPTIONS, **layout)
        for urls, pack in zip(corpora, packs, strict=True)
    ]
    return Mix(streams, weights, policy=policy)


def stream_of(seq: dict[str, Any]) -> int:
    return int(int(seq["input_ids"][0]) >= OFFSET)


def ids_of(seq: dict[str, Any]) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in row) for row in seq["__id__"]]


CONCAT = Pack(SEQ, field="ids", pad_id=-1)
BEST_FIT = Pack(SEQ, field="ids", mode="best_fit", window=4, pad_id=-1)


def test_sequences_mix_by_weight_each_planned_from_its_token_counts(corpora) -> None:
    mix = mixture(corpora, (CONCAT, BEST_FIT), [3, 1])
    seqs = list(mix)
    assert {len(s["input_ids"]) for s in seqs} == {SEQ + 1}
    # One slot plans ceil(tokens / (seq_len + 1)) sequences of each stream;
    # the mixture takes them by weight, as it takes samples.
    available = [math.ceil(len(tokens_of(urls)) / (SEQ + 1)) for urls in corpora]
    taken = Counter(stream_of(s) for s in seqs)
    assert [taken[0], taken[1]] == mix_counts("stop", [3.0, 1.0], available)
    assert len(seqs) == mix.num_samples()
    # The mixture's ids: stream b's shards come after stream a's 4.
    for seq in seqs:
        shards = {row[1] for row in ids_of(seq)}
        assert shards <= (set(range(4)) if stream_of(seq) == 0 else {4, 5, 6}), shards
        assert int(seq["__epoch__"][0]) == 0


def test_under_continue_every_token_of_each_stream_comes_once(corpora) -> None:
    mix = mixture(corpora, (CONCAT, CONCAT), [1, 4], policy="continue")
    loader = DataLoader(mix, batch_size=None, num_workers=2)
    got = sorted(t for seq in loader for t in real_tokens(seq, CONCAT))
    assert got == sorted(tokens_of(corpora[0]) + tokens_of(corpora[1]))


def test_restart_passes_carry_the_mixture_epoch_and_pass_shards(corpora) -> None:
    mix = mixture(corpora, (CONCAT, BEST_FIT), [1, 8], policy="restart")
    mix.set_epoch(2)
    seqs = list(mix)
    rows = [row for seq in seqs for row in ids_of(seq)]
    assert {row[0] for row in rows} == {2}
    assert {int(s["__epoch__"][0]) for s in seqs} == {2}
    # Stream b (weight 8) runs out long before the mixture ends and is read
    # again: pass 1's shards are numbered after every stream's 7.
    assert any(row[1] >= 7 for row in rows)


def test_exact_resume_in_workers_continues_the_same_sequences(corpora) -> None:
    packs = (CONCAT, BEST_FIT)

    def loader(mix: Mix) -> StatefulDataLoader:
        return StatefulDataLoader(mix, batch_size=None, num_workers=2)

    whole = [(s["input_ids"].tolist(), ids_of(s)) for s in loader(mixture(corpora, packs, [2, 1]))]
    first = loader(mixture(corpora, packs, [2, 1]))
    it = iter(first)
    head = [next(it) for _ in range(9)]
    state = first.state_dict()
    del it
    resumed = loader(mixture(corpora, packs, [2, 1]))
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert [(s["input_ids"].tolist(), ids_of(s)) for s in head + rest] == whole


@pytest.mark.parametrize("weights", [[1, 8], [1, 3], [1, 0]])
def test_exact_resume_under_restart_from_the_last_passes_and_the_end(corpora, weights) -> None:
    # A restarted stream's last pass is cut to what the mixture takes of
    # it; its sequences left still count down from the whole pass.
    whole = [
        (s["input_ids"].tolist(), ids_of(s))
        for s in mixture(corpora, (CONCAT, BEST_FIT), weights, "restart")
    ]
    for at in (3, len(whole) - 40, len(whole) - 1, len(whole)):
        mix = mixture(corpora, (CONCAT, BEST_FIT), weights, "restart")
        it = iter(mix)
        head = [next(it) for _ in range(at)]
        state = json.loads(json.dumps(mix.state_dict()))
        resumed = mixture(corpora, (CONCAT, BEST_FIT), weights, "restart")
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert [(s["input_ids"].tolist(), ids_of(s)) for s in head + rest] == whole, at


def test_elastic_resume_onto_another_layout_repeats_no_token(corpora) -> None:
    read: list[int] = []
    states = []
    per_rank = []
    for rank in range(2):
        mix = mixture(corpora, (CONCAT, CONCAT), [1, 1], "continue", rank=rank, world_size=2)
        loader = StatefulDataLoader(mix, batch_size=None, num_workers=2)
        it = iter(loader)
        seqs = [next(it) for _ in range(5)]
        read += [t for s in seqs for t in real_tokens(s, CONCAT)]
        states.append(json.loads(json.dumps(loader.state_dict())))
        del it
        per_rank.append(mix.num_samples(2))
    # Both ranks plan the same sequences (the least over the ranks).
    assert per_rank[0] == per_rank[1] > 5
    resumed = mixture(corpora, (CONCAT, CONCAT), [1, 1], "continue")
    resumed.load_state_dict(elastic_state(*states))
    rest = list(DataLoader(resumed, batch_size=None, num_workers=3))
    assert rest
    got = Counter(read + [t for s in rest for t in real_tokens(s, CONCAT)])
    assert max(got.values()) == 1
    everything = set(tokens_of(corpora[0]) + tokens_of(corpora[1]))
    assert set(got) <= everything
    # On one rank the rest plans every token it holds: only what the two
    # ranks' equal plans left out before the resume is missing.
    assert len(everything) - len(got) < 2 * 2 * (SEQ + 1) * 2


def test_two_ranks_take_equal_sequences_and_no_document_twice(corpora) -> None:
    per_rank = []
    for rank in range(2):
        mix = mixture(corpora, (BEST_FIT, CONCAT), [1, 2], rank=rank, world_size=2)
        per_rank.append(list(DataLoader(mix, batch_size=None, num_workers=2)))
    assert len(per_rank[0]) == len(per_rank[1]) > 0
    ended = Counter(row for seqs in per_rank for s in seqs for row in ids_of(s))
    assert max(ended.values()) == 1


def test_packed_mixtures_that_cannot_mix_are_refused_at_construction(
    corpora, tmp_path: Path
) -> None:
    a, b = corpora
    packed = StreamingDataset(a, pack=CONCAT, **OPTIONS)
    with pytest.raises(ValueError, match="option pack: stream 1 does not pack"):
        Mix([packed, StreamingDataset(b, **OPTIONS)])
    other = StreamingDataset(b, pack=Pack(SEQ * 2, field="ids"), **OPTIONS)
    with pytest.raises(ValueError, match=r"stream 1 packs sequences of seq_len=32"):
        Mix([packed, other])
    # Without token counts no stream can plan its sequences.
    bare = write_docs(tmp_path / "bare", shards=2)
    unindexed = StreamingDataset(bare, pack=CONCAT, count_samples=True, **OPTIONS)
    with pytest.raises(ValueError, match=r"option pack: .*in a mixture.*--count-tokens ids"):
        Mix([packed, unindexed])


def test_verify_reads_a_packed_mixture_s_ledger(corpora, tmp_path, capfd) -> None:
    mix = mixture(corpora, (CONCAT, BEST_FIT), [2, 1])
    ledger_dir = tmp_path / "ledger"
    with Ledger(ledger_dir, mix) as ledger:
        steps = sum(1 for _ in ledger.track(DataLoader(mix, batch_size=None)))
    assert steps == mix.num_samples()
    capfd.readouterr()
    assert run_cli(["shardstream", "verify", str(ledger_dir)]) == 0
    out = capfd.readouterr().out
    # One process (its worker count known from the loader): each stream's
    # order replayed, the sequences the mixture takes end every document.
    assert "ok: every sample exactly once" in out, out
    assert re.search(r"epoch 0: (\d+) of \1 samples .* left out past the planned", out), out
    # The same documents recorded twice are named.
    twice = tmp_path / "twice"
    seqs = list(DataLoader(mix, batch_size=None))
    with Ledger(twice, mix) as ledger:
        for seq in seqs + seqs[-3:]:
            ledger.record(seq)
    capfd.readouterr()
    assert run_cli(["shardstream", "verify", str(twice)]) == 1
    assert "twice" in capfd.readouterr().out


@pytest.mark.parametrize(
    ("policy", "lose", "workers_known"),
    [
        ("stop", None, True),
        ("restart", None, True),
        ("continue", None, True),
        ("stop", "short", True),
        ("restart", "short", True),
        ("stop", "extra", True),
        ("stop", None, False),
    ],
    ids=[
        "stop",
        "restart",
        "continue",
        "stop-lost",
        "restart-lost",
        "stop-pass-1-recorded",
        "workers-unknown",
    ],
)
def test_verify_replays_a_packed_mixture_across_ranks(
    corpora, tmp_path: Path, capfd, policy: str, lose: str | None, workers_known: bool
) -> None:
    """Two ranks of two workers mix a best-fit and a concatenating stream:
    ``verify`` plans each slot's mixture from the streams' planned
    sequences, replays each pass's order of documents (shuffle buffer,
    packer) and proves the documents the taken sequences end are exactly
    those recorded. Records that lost the shortest document handed out are
    a violation naming it, and so are records naming a document of a pass
    the mixture never reads; a ledger that does not know the worker count
    is checked for no document twice only."""
    ledger_dir = tmp_path / "ledger"
    mixes = [
        mixture(corpora, (BEST_FIT, CONCAT), [1, 2], policy, rank=rank, world_size=2)
        for rank in (0, 1)
    ]
    runs = [list(DataLoader(mix, batch_size=None, num_workers=2)) for mix in mixes]
    handed = [row for seqs in runs for s in seqs for row in ids_of(s)]
    assert len(runs[0]) == len(runs[1]) > 0 and len(set(handed)) == len(handed)
    # Stream 1's documents are numbered after stream 0's four shards (and
    # before the next pass's).
    lengths = {
        (s, i): len(json.loads(line)["ids"])
        for s, url in enumerate(corpora[0] + corpora[1])
        for i, line in enumerate(Path(url).read_text().splitlines())
    }
    shards = len(corpora[0]) + len(corpora[1])
    shortest = min(handed, key=lambda row: (lengths[row[1] % shards, row[2]], row))
    extra: list[torch.Tensor] = []
    for mix, seqs in zip(mixes, runs, strict=True):
        with Ledger(ledger_dir, mix, num_workers=2 if workers_known else None) as ledger:
            for seq in seqs:
                ids = seq["__id__"]
                if lose == "short":
                    kept = ids[(ids[:, 1] != shortest[1]) | (ids[:, 2] != shortest[2])]
                    ids = kept if len(kept) else ids[:0]
                elif lose == "extra" and len(ids) and not extra:
                    # The same document of the stream's next pass, which
                    # "stop" never reads.
                    extra.append(ids[:1] + torch.tensor([0, shards, 0]))
                    ids = torch.cat([ids, *extra])
                ledger.record({**seq, "__id__": ids})
            ledger.epoch_end(0)
    capfd.readouterr()
    code = run_cli(["shardstream", "verify", str(ledger_dir)])
    out = capfd.readouterr().out
    if not workers_known:
        assert code == 0 and "at most once (a mixture of packed streams" in out, out
    elif lose == "extra":
        assert code == 1 and "which the mixture's plan does not take" in out, out
    elif lose is not None:
        assert code == 1 and "never came" in out, out
        url = (corpora[0] + corpora[1])[shortest[1] % shards]
        assert f"sample {shortest[2]} of {url}" in out, out
    else:
        assert code == 0 and "ok: every sample exactly once" in out, out
        assert f"epoch 0: {len(handed)} of {len(handed)} samples" in out, out


@pytest.mark.parametrize("resume", ["exact", "elastic"])
def test_verify_replays_a_packed_mixture_resumed_within_its_epoch(
    corpora, tmp_path: Path, capfd, resume: str
) -> None:
    """A packed mixture across two ranks of two workers, killed after a
    checkpoint and resumed in a new generation: an exact resume continues
    the plan, and verify proves the epoch exactly once from the records
    that count; an elastic resume onto the same layout plans the rest
    anew, and verify's verdict must match the truth (at most once, saying
    why, where the documents recorded are not the uninterrupted run's)."""
    ledger_dir = tmp_path / "ledger"

    def make(rank: int) -> Mix:
        return mixture(corpora, (BEST_FIT, CONCAT), [1, 2], rank=rank, world_size=2)

    counted = record_a_resumed_run(ledger_dir, make, resume)
    whole = uninterrupted_ids(make)
    capfd.readouterr()
    code = run_cli(["shardstream", "verify", str(ledger_dir)])
    same = check_resumed_verdict(capfd.readouterr().out, code, counted, whole)
    assert same or resume == "elastic"


def test_verify_names_a_repeated_document_of_a_packed_stream(tmp_path, capfd) -> None:
    """A packed stream is cut by tokens, never padded (``remainder="pad"``
    is refused with ``pack``): a document recorded twice is a violation,
    with a document count that does not divide among the ranks too."""
    corpora = indexed(tmp_path / "a", 4, 0), indexed(tmp_path / "b", 3, OFFSET, docs=21)
    ledger_dir = tmp_path / "ledger"
    for rank in (0, 1):
        mix = mixture(corpora, (CONCAT, CONCAT), [1, 1], rank=rank, world_size=2)
        seqs = list(DataLoader(mix, batch_size=None))
        # Stream 1's last document handed out, recorded a second time.
        again = next(s for s in reversed(seqs) if stream_of(s) == 1 and len(s["__id__"]))
        if rank == 1:
            # Recorded again in the rank's last step (as many steps).
            last = seqs[-1]
            seqs[-1] = {**last, "__id__": torch.cat([last["__id__"], again["__id__"][:1]])}
        with Ledger(ledger_dir, mix, num_workers=1) as ledger:
            for seq in seqs:
                ledger.record(seq)
            ledger.epoch_end(0)
    capfd.readouterr()
    assert run_cli(["shardstream", "verify", str(ledger_dir)]) == 1
    out = capfd.readouterr().out
    assert "twice" in out and "repeated by pad" not in out, out


def test_verify_says_which_packed_mixture_order_was_not_replayed(corpora, tmp_path, capfd) -> None:
    """One stream whose shuffle buffer may let a document out early by its
    byte bound: its order is not replayed, so the epoch is checked for no
    document twice, and a note says why."""
    a, b = corpora
    streams = [
        StreamingDataset(a, pack=BEST_FIT, **{**OPTIONS, "shuffle_buffer_bytes": 64}),
        StreamingDataset(b, pack=CONCAT, **OPTIONS),
    ]
    mix = Mix(streams, [1, 2])
    ledger_dir = tmp_path / "ledger"
    with Ledger(ledger_dir, mix) as ledger:
        for _ in ledger.track(DataLoader(mix, batch_size=None)):
            pass
    capfd.readouterr()
    assert run_cli(["shardstream", "verify", str(ledger_dir)]) == 0
    out = capfd.readouterr().out
    assert "at most once (a mixture of packed streams" in out, out
    assert "was not replayed" in out and "may pass shuffle_buffer_bytes" in out, out

"""``shardstream.Mix``: weighted mixtures of streams. Property tests over
layouts, weights and policies (equal ranks, each stream's samples at most
once, all of them under ``continue``), determinism, exact resume through
``StatefulDataLoader``, elastic resume onto other layouts, weights changed at
a resume, and model-parallel groups of a plain dataset."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from _shardtest import (
    DatasetInfo,
    collect,
    index_manifest,
    load_schema,
    member_offsets,
    write_tar,
    write_uneven_dataset,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

import shardstream
from shardstream import (
    Mix,
    ShardSkippedWarning,
    StateMismatchError,
    StreamingDataset,
    _core,
    elastic_state,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

# Even totals (66 and 24): with 2 ranks, no stream drops a remainder.
COUNTS_A = (10, 20, 30, 6)
COUNTS_B = (7, 8, 9)
MIX_STATE = jsonschema.Draft202012Validator(load_schema("mix_state"))
STREAM_STATE = jsonschema.Draft202012Validator(load_schema("state"))


@pytest.fixture(scope="module")
def streams(tmp_path_factory: pytest.TempPathFactory) -> tuple[DatasetInfo, DatasetInfo]:
    root = tmp_path_factory.mktemp("mix")
    a = write_uneven_dataset(root / "a", COUNTS_A, prefix="a", seed=1)
    b = write_uneven_dataset(root / "b", COUNTS_B, prefix="b", seed=2)
    return a, b


def ident(sample: dict) -> str:
    """A sample's stream (its shard's directory) and key."""
    return f"{Path(sample['__url__']).parent.name}/{sample['__key__']}"


def stream_keys(info: DatasetInfo) -> set[str]:
    name = Path(info.paths[0]).parent.name
    return {f"{name}/{key}" for key in info.keys}


def make_mix(streams, weights=(0.7, 0.3), policy="continue", **slot) -> Mix:
    datasets = [StreamingDataset(info.spec, seed=3, shuffle_buffer=5, **slot) for info in streams]
    return Mix(datasets, list(weights), policy=policy, seed=11)


def slot_keys(streams, weights, policy, rank, world_size, worker_id, num_workers, epoch=0):
    mix = make_mix(
        streams,
        weights,
        policy,
        rank=rank,
        world_size=world_size,
        worker_id=worker_id,
        num_workers=num_workers,
    )
    mix.set_epoch(epoch)
    return [ident(s) for s in collect(mix)]


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    world_size=st.integers(1, 3),
    num_workers=st.integers(1, 3),
    weights=st.lists(st.floats(0.05, 5.0), min_size=2, max_size=2),
    policy=st.sampled_from(["stop", "restart", "continue"]),
    epoch=st.integers(0, 3),
)
def test_equal_ranks_and_each_stream_once_over_any_layout(
    streams, world_size, num_workers, weights, policy, epoch
):
    """Every rank takes the same number of samples; each stream's samples
    come at most once per pass (once under ``continue``: every one of the
    stream's epoch); ``stop`` ends where a stream runs out, ``restart``
    reads every sample of every stream at least once."""
    per_rank: list[list[str]] = []
    for rank in range(world_size):
        keys: list[str] = []
        for worker in range(num_workers):
            keys += slot_keys(
                streams, weights, policy, rank, world_size, worker, num_workers, epoch
            )
        per_rank.append(keys)
    assert len({len(k) for k in per_rank}) == 1, [len(k) for k in per_rank]
    got = Counter(k for keys in per_rank for k in keys)
    for info in streams:
        expected = stream_keys(info)
        # Each stream's plan drops its total % world_size (remainder="drop").
        planned = len(expected) - len(expected) % world_size
        mine = {k: n for k, n in got.items() if k in expected}
        assert set(got) <= set().union(*(stream_keys(i) for i in streams))
        if policy == "continue":
            assert all(n == 1 for n in mine.values())
            assert len(mine) == planned
        elif policy == "stop":
            assert all(n == 1 for n in mine.values())
        else:
            assert len(mine) == planned
    if policy == "stop":
        # One stream is read to its end (per slot: up to rounding).
        shares = [
            sum(n for k, n in got.items() if k in stream_keys(info))
            / (len(stream_keys(info)) - len(stream_keys(info)) % world_size)
            for info in streams
        ]
        assert max(shares) >= 1 - 2 * world_size * num_workers / 24


@settings(max_examples=150, deadline=None)
@given(
    shard_counts=st.lists(
        st.lists(st.integers(0, 40), min_size=1, max_size=12), min_size=1, max_size=4
    ),
    world_size=st.integers(1, 8),
    num_workers=st.integers(1, 8),
    weights=st.lists(st.just(0.0) | st.floats(0.01, 10.0), min_size=4, max_size=4),
    policy=st.sampled_from(["stop", "restart", "continue"]),
    seed=st.integers(0, 2**64 - 1),
    epoch=st.integers(0, 2**32 - 1),
)
def test_pure_mixture_plans_give_every_rank_the_same_count(
    shard_counts, world_size, num_workers, weights, policy, seed, epoch
):
    """Over any layout (no I/O): each slot's order holds each stream exactly
    its count, the counts follow the policy, and every rank's total is the
    same, since a stream's plan gives worker ``w`` of every rank as many
    samples."""
    weights = weights[: len(shard_counts)]
    if not any(w > 0 for w in weights):
        weights[0] = 1.0
    plans = [
        shardstream.plan_samples(
            counts, seed=seed, epoch=epoch, world_size=world_size, num_workers=num_workers
        )
        for counts in shard_counts
    ]
    totals = []
    for rank in range(world_size):
        total = 0
        for worker in range(num_workers):
            slot = rank * num_workers + worker
            available = [sum(end - start for _, start, end in plan[slot]) for plan in plans]
            counts = _core.mix_counts(policy, weights, available)
            order = _core.mix_order(
                policy, weights, counts, seed=seed, epoch=epoch, slot=slot, generation=1
            )
            assert [order.count(bytes([s])) for s in range(len(counts))] == counts
            for s, (n, a) in enumerate(zip(counts, available, strict=True)):
                if weights[s] == 0:
                    assert n == 0
                elif policy == "continue":
                    assert n == a
                elif policy == "stop":
                    assert n <= a
                else:
                    assert n >= a
            total += len(order)
        totals.append(total)
    assert len(set(totals)) == 1, totals


def test_the_mixture_order_is_deterministic_and_follows_seed_and_epoch(streams):
    first = slot_keys(streams, (0.5, 0.5), "stop", 0, 1, 0, 1)
    assert first == slot_keys(streams, (0.5, 0.5), "stop", 0, 1, 0, 1)
    assert first != slot_keys(streams, (0.5, 0.5), "stop", 0, 1, 0, 1, epoch=1)


def test_persistent_workers_take_the_next_epoch_by_themselves(streams):
    """Persistent workers start reading their next epoch's streams when
    their mixture ends (more than one epoch's bytes are read before the
    next iteration asks); the epochs stay those of a fresh mixture told its
    epoch, and a state taken inside the early-started epoch resumes
    exactly."""
    mix = make_mix(streams)
    loader = StatefulDataLoader(
        mix,
        batch_size=None,
        num_workers=2,
        persistent_workers=True,
        collate_fn=ident,
        timeout=120,
    )
    one_epoch = sum(os.path.getsize(p) for info in streams for p in info.paths)
    epochs = [list(loader)]
    deadline = time.monotonic() + 10
    while sum(s["bytes_read"] for s in mix.stats()) <= one_epoch and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(s["bytes_read"] for s in mix.stats()) > one_epoch, "no read of epoch 1 began"
    iterator = iter(loader)
    first = [next(iterator) for _ in range(7)]
    state = loader.state_dict()
    rest = list(iterator)
    epochs.append(first + rest)
    # Epoch 1 read its started streams, not streams of its own: with epoch
    # 2's started at its end, three epochs' bytes are read, not four.
    deadline = time.monotonic() + 10
    while sum(s["bytes_read"] for s in mix.stats()) < 3 * one_epoch:
        assert time.monotonic() < deadline, "epoch 2's reads did not begin"
        time.sleep(0.01)
    time.sleep(0.2)
    assert sum(s["bytes_read"] for s in mix.stats()) == 3 * one_epoch
    everything = stream_keys(streams[0]) | stream_keys(streams[1])
    for keys in epochs:
        assert sorted(keys) == sorted(everything)
    assert epochs[0] != epochs[1]
    for epoch, keys in enumerate(epochs):
        fresh_mix = make_mix(streams)
        fresh_mix.set_epoch(epoch)
        fresh = StatefulDataLoader(
            fresh_mix, batch_size=None, num_workers=2, collate_fn=ident, timeout=120
        )
        assert list(fresh) == keys
    resumed = StatefulDataLoader(
        make_mix(streams), batch_size=None, num_workers=2, collate_fn=ident, timeout=120
    )
    resumed.load_state_dict(state)
    assert list(resumed) == rest


def test_the_next_iteration_takes_the_started_streams_only_if_it_would_open_them(streams):
    """The streams started at a mixture's end are the next iteration's only
    if it begins their epoch fresh: not after ``set_epoch`` to another
    epoch, nor with a loaded state pending; a stream the epoch's weights no
    longer read is dropped. Either way the order is the epoch's own."""

    def taken(stream) -> bool:
        return json.loads(stream.state())["produced"] > 0

    def epoch_keys(epoch: int) -> list[str]:
        return slot_keys(streams, (0.7, 0.3), "continue", 0, 1, 0, 1, epoch=epoch)

    mix = make_mix(streams)
    assert [ident(s) for s in collect(mix)] == epoch_keys(0)
    mix._start_next()
    started = list(mix._next_streams[4].values())
    assert len(started) == 2
    assert [ident(s) for s in collect(mix)] == epoch_keys(1)
    assert all(taken(stream) for stream in started)

    mix._start_next()
    started = list(mix._next_streams[4].values())
    mix.set_epoch(7)
    assert [ident(s) for s in collect(mix)] == epoch_keys(7)
    assert not any(taken(stream) for stream in started)

    iterator = iter(mix)
    first = [ident(next(iterator)) for _ in range(5)]
    state = mix.state_dict()
    rest = [ident(s) for s in collect(iterator)]
    assert first + rest == epoch_keys(8)
    mix._start_next()
    started = list(mix._next_streams[4].values())
    mix.load_state_dict(state)
    assert [ident(s) for s in collect(mix)] == rest
    assert not any(taken(stream) for stream in started)

    # Weights set after the start: the stream they no longer read is not
    # the mixture's (it would hold its read-ahead for the whole epoch).
    mix._start_next()
    started = dict(mix._next_streams[4])
    assert sorted(started) == [(0, 9), (1, 9)]
    mix.set_weights([1, 0])
    refs = {(0, 9): sys.getrefcount(started[(0, 9)]), (1, 9): sys.getrefcount(started[(1, 9)])}
    iterator = iter(mix)
    first = [ident(next(iterator))]
    # The mixture's own, or no longer referenced but by `started` (counted
    # outside the asserts, whose rewriting holds values of its own).
    now = {(0, 9): sys.getrefcount(started[(0, 9)]), (1, 9): sys.getrefcount(started[(1, 9)])}
    assert now[(0, 9)] >= refs[(0, 9)]
    assert now[(1, 9)] == refs[(1, 9)] - 1
    only_a = slot_keys(streams, (1, 0), "continue", 0, 1, 0, 1, epoch=9)
    assert first + [ident(s) for s in collect(iterator)] == only_a


def test_a_mixture_in_the_main_process_starts_its_next_epoch_from_its_second_on(streams):
    """As a dataset does: the first epoch's end starts nothing, the second's
    starts the next epoch's streams, which the third iteration takes."""
    mix = make_mix(streams)
    first = [ident(s) for s in collect(mix)]
    assert first == slot_keys(streams, (0.7, 0.3), "continue", 0, 1, 0, 1)
    assert mix._next_streams is None, "a single pass started the next epoch"
    second = [ident(s) for s in collect(mix)]
    assert second == slot_keys(streams, (0.7, 0.3), "continue", 0, 1, 0, 1, epoch=1)
    assert mix._next_streams is not None, "the second epoch's end started nothing"
    started = dict(mix._next_streams[4])
    assert started and all(stream.started for stream in started.values())
    assert {epoch for _, epoch in started} == {2}
    third = [ident(s) for s in collect(mix)]
    assert third == slot_keys(streams, (0.7, 0.3), "continue", 0, 1, 0, 1, epoch=2)


def test_only_streams_the_next_mixture_takes_samples_of_start_early(streams):
    """A stream with a weight above 0 may give a slot no sample (here its
    weight is too small for one under ``"stop"``): it is not started."""
    mix = make_mix(streams, (1, 1e-9), "stop")
    keys = [ident(s) for s in collect(mix)]
    assert keys and all(k.startswith("a/") for k in keys)
    mix._start_next()
    started = {key: stream.started for key, stream in mix._next_streams[4].items()}
    assert started == {(0, 1): True, (1, 1): False}
    # The stream not started is the mixture's too: it is not opened twice.
    unstarted = mix._next_streams[4][(1, 1)]
    before = sys.getrefcount(unstarted)
    iterator = iter(mix)
    # No longer in `_next_streams`, and held by the mixture.
    after = sys.getrefcount(unstarted)
    assert after == before
    assert [ident(s) for s in collect(iterator)] == slot_keys(
        streams, (1, 1e-9), "stop", 0, 1, 0, 1, epoch=1
    )


@pytest.mark.parametrize("where", ["slot", "stream"])
def test_an_error_starting_the_next_epoch_does_not_end_the_epoch_in_error(
    streams, monkeypatch: pytest.MonkeyPatch, where: str
):
    """What stops the next epoch's early start (the slot cannot be found, a
    stream cannot be opened) does not fail the epoch that ended; the next
    iteration opens its own streams and raises it then."""
    mix = make_mix(streams)
    iterator = iter(mix)
    iterator.on_end = mix._start_next

    def fails(*args, **kwargs):
        raise ValueError("cannot")

    if where == "slot":
        monkeypatch.setattr(mix, "_slot", fails)
    else:
        monkeypatch.setattr(mix.datasets[1], "slot_stream", fails)
    keys = [ident(s) for s in collect(iterator)]
    assert keys == slot_keys(streams, (0.7, 0.3), "continue", 0, 1, 0, 1)
    assert mix._next_streams is None
    with pytest.raises(ValueError, match="cannot"):
        iter(mix)


def test_set_weights_reaches_persistent_workers(streams):
    mix = make_mix(streams, (0.5, 0.5), "stop")
    loader = StatefulDataLoader(
        mix, batch_size=None, num_workers=2, persistent_workers=True, collate_fn=ident, timeout=120
    )
    first = list(loader)
    assert sum(k.startswith("a/") for k in first) == sum(k.startswith("b/") for k in first)
    # The workers were made with the first weights and persist: the new
    # ones reach them (the same counts as a fresh mixture with them).
    mix.set_weights([0.25, 0.75])
    second = list(loader)
    assert sum(k.startswith("b/") for k in second) == sum(COUNTS_B)
    assert sum(k.startswith("a/") for k in second) == mix.num_samples(2) - sum(COUNTS_B)
    assert sum(k.startswith("a/") for k in second) < sum(COUNTS_B) // 2


def test_stop_takes_the_weights_exactly(streams):
    weights = (0.75, 0.25)
    keys = slot_keys(streams, weights, "stop", 0, 1, 0, 1)
    took = [sum(k in stream_keys(info) for k in keys) for info in streams]
    available = [sum(COUNTS_A), sum(COUNTS_B)]
    # The stream that runs out first (relative to its weight) is read to
    # its end; the other gives weight-proportionally many, rounded down.
    m = min(range(2), key=lambda s: available[s] / weights[s])
    expected = [int(available[m] * weights[s] / weights[m] + 1e-9) for s in range(2)]
    assert took == expected


def test_set_weights_applies_from_the_next_epoch(streams):
    mix = make_mix(streams, (0.5, 0.5), "stop")
    first = [ident(s) for s in collect(mix)]
    assert sum(k.startswith("a/") for k in first) == sum(k.startswith("b/") for k in first)
    mix.set_weights([0.25, 0.75])
    second = [ident(s) for s in collect(mix)]
    # b (24 samples) is the limit: a gives a third as many.
    assert sum(k.startswith("b/") for k in second) == sum(COUNTS_B)
    assert sum(k.startswith("a/") for k in second) == sum(COUNTS_B) // 3
    # Set while an epoch is read: from the next one on; a worker that
    # starts the running epoch late still mixes it by its weights.
    running = iter(mix)
    next(running)
    mix.set_weights([0.5, 0.5])
    assert mix._epoch_weights(running.epoch) == [0.25, 0.75]
    assert mix._epoch_weights(running.epoch + 1) == mix.weights == [0.5, 0.5]
    # A loaded state's epoch keeps the state's weights: set_weights then
    # starts at the epoch after it.
    state = mix.state_dict()
    resumed = make_mix(streams, (0.25, 0.75), "stop")
    resumed.load_state_dict(state)
    resumed.set_weights([0.75, 0.25])
    assert resumed._epoch_weights(state["epoch"]) == [0.25, 0.75]
    assert resumed._epoch_weights(state["epoch"] + 1) == [0.75, 0.25]
    with pytest.raises(ValueError, match="invalid option weights"):
        mix.set_weights([1.0, -1.0])


def test_model_parallel_ranks_get_identical_samples(streams):
    info = streams[0]

    def keys(rank: int) -> list[str]:
        ds = StreamingDataset(
            info.spec, seed=3, rank=rank, world_size=4, model_parallel_size=2, shuffle_buffer=5
        )
        assert ds.distributed_slot() == (rank // 2, 2)
        return [s["__key__"] for s in collect(ds)]

    ranks = [keys(r) for r in range(4)]
    assert ranks[0] == ranks[1] and ranks[2] == ranks[3]
    assert not set(ranks[0]) & set(ranks[2])
    assert sorted(ranks[0] + ranks[2]) == sorted(info.keys)


def test_model_parallel_dataset_states_resume_elastically(streams):
    """A group's ranks save identical states; gathered, they count once."""
    info = streams[0]
    read, states = {}, []
    for rank in range(4):
        ds = StreamingDataset(
            info.spec, seed=3, rank=rank, world_size=4, model_parallel_size=2, shuffle_buffer=5
        )
        it = iter(ds)
        read[rank] = [next(it)["__key__"] for _ in range(7)]
        states.append(ds.state_dict())
        del it
    assert read[0] == read[1] and states[0] == states[1]
    resumed = StreamingDataset(info.spec, seed=3, shuffle_buffer=5)
    resumed.load_state_dict(elastic_state(*states))
    rest = [s["__key__"] for s in collect(resumed)]
    assert sorted(read[0] + read[2] + rest) == sorted(info.keys)


def test_model_parallel_size_is_checked_at_construction(streams):
    spec = streams[0].spec
    with pytest.raises(ValueError, match="model_parallel_size"):
        StreamingDataset(spec, model_parallel_size=0)
    with pytest.raises(TypeError, match="model_parallel_size"):
        StreamingDataset(spec, model_parallel_size="2")  # type: ignore[typeddict-item]
    with pytest.raises(ValueError, match="model_parallel_size: 2 does not divide world_size 3"):
        StreamingDataset(spec, rank=0, world_size=3, model_parallel_size=2)


def test_bad_mixtures_are_refused_at_construction(streams):
    a, b = streams
    ds = [StreamingDataset(a.spec), StreamingDataset(b.spec)]
    with pytest.raises(ValueError, match="invalid option weights"):
        Mix(ds, [0.0, 0.0])
    with pytest.raises(ValueError, match="invalid option weights"):
        Mix(ds, [1.0, float("nan")])
    with pytest.raises(ValueError, match="invalid option weights: 1 weights for 2"):
        Mix(ds, [1.0])
    with pytest.raises(ValueError, match="invalid option policy"):
        Mix(ds, policy="cycle")
    with pytest.raises(ValueError, match="share one layout"):
        Mix([StreamingDataset(a.spec, rank=0, world_size=2), ds[1]])
    with pytest.raises(ValueError, match="batches"):
        Mix([StreamingDataset(a.spec, batch_size=4), ds[1]])
    with pytest.raises(shardstream.DatasetSpecError, match="shardstream index"):
        Mix([StreamingDataset(a.spec, count_samples=False), ds[1]])


def test_weights_may_be_a_numpy_array_or_a_tensor(streams):
    a, b = streams
    ds = [StreamingDataset(a.spec), StreamingDataset(b.spec)]
    by_list = [ident(s) for s in Mix(ds, [3.0, 1.0])]
    for weights in (np.array([3.0, 1.0]), torch.tensor([3, 1]), [np.float32(3), np.int64(1)]):
        mix = Mix(ds, weights)
        assert mix.weights == [3.0, 1.0]
        assert all(type(w) is float for w in mix.weights)
        assert [ident(s) for s in mix] == by_list
    mix.set_weights(np.array([1.0, 2.0]))
    assert mix.weights == [1.0, 2.0]
    for bad in (np.ones((2, 1)), np.float64(1.0), [np.bool_(True), 1.0], ["1", "1"]):
        with pytest.raises(TypeError, match="invalid option weights: expected a list of numbers"):
            Mix(ds, bad)
    with pytest.raises(ValueError, match="invalid option weights"):
        Mix(ds, np.array([1.0, np.inf]))


# --------------------------------------------------------------------------
# Exact resume through StatefulDataLoader
# --------------------------------------------------------------------------


def collate_idents(samples: list[dict]) -> list[str]:
    return [ident(s) for s in samples]


def mix_loader(streams, num_workers, policy, **slot) -> StatefulDataLoader:
    mix = make_mix(streams, policy=policy, **slot)
    mix.set_epoch(2)
    return StatefulDataLoader(
        mix,
        batch_size=4,
        num_workers=num_workers,
        collate_fn=collate_idents,
        timeout=120 if num_workers else 0,
    )


def mix_states(obj) -> list[dict]:
    found: list[dict] = []
    if isinstance(obj, dict):
        if obj.get("format") == "shardstream.mix":
            return [obj]
        for value in obj.values():
            found += mix_states(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            found += mix_states(value)
    return found


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("policy", ["stop", "restart", "continue"])
def test_exact_resume_at_several_points(streams, num_workers, policy):
    reference = list(mix_loader(streams, num_workers, policy))
    assert len(reference) > 8
    for stop in (1, 4, len(reference) - 2):
        loader = mix_loader(streams, num_workers, policy)
        it = iter(loader)
        before = [next(it) for _ in range(stop)]
        state = json.loads(json.dumps(loader.state_dict()))
        del it
        for slot in mix_states(state):
            MIX_STATE.validate(slot)
            for entry in slot["streams"]:
                STREAM_STATE.validate(entry["state"])
        resumed = mix_loader(streams, num_workers, policy)
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert before + rest == reference, f"stop {stop}"


def test_an_exact_state_of_another_slot_or_weights_is_refused(streams):
    mix = make_mix(streams)
    it = iter(mix)
    for _ in range(5):
        next(it)
    state = mix.state_dict()
    other = make_mix(streams, rank=1, world_size=2)
    other.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="state field rank"):
        iter(other)
    with pytest.raises(StateMismatchError, match="weights"):
        make_mix(streams, weights=(0.5, 0.5)).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="elastic_state"):
        make_mix(streams).load_state_dict(state, weights=[0.5, 0.5])
    bad = json.loads(json.dumps(state))
    bad["position"] += 1
    mix = make_mix(streams)
    mix.load_state_dict(bad)
    with pytest.raises(StateMismatchError, match="produced"):
        iter(mix)


# --------------------------------------------------------------------------
# Elastic resume and weights changed at a resume
# --------------------------------------------------------------------------


def save_two_by_two(streams, batches: int):
    """Two ranks of two workers each read ``batches`` batches; returns what
    they read and the elastic state of the job."""
    read: list[str] = []
    states = []
    for rank in range(2):
        loader = mix_loader(streams, 2, "continue", rank=rank, world_size=2)
        it = iter(loader)
        for _ in range(batches):
            read += next(it)
        states.append(json.loads(json.dumps(loader.state_dict())))
        del it
    gathered = elastic_state(*states)
    MIX_STATE.validate(gathered)
    return read, gathered


def resume_onto(streams, state, world_size, num_workers, weights=None) -> list[list[str]]:
    per_rank = []
    for rank in range(world_size):
        mix = make_mix(streams, rank=rank, world_size=world_size)
        mix.load_state_dict(state, weights=weights)
        loader = StatefulDataLoader(
            mix,
            batch_size=4,
            num_workers=num_workers,
            collate_fn=collate_idents,
            timeout=120 if num_workers else 0,
        )
        per_rank.append([k for batch in loader for k in batch])
    return per_rank


@pytest.mark.parametrize(("world_size", "num_workers"), [(1, 3), (2, 3)])
def test_elastic_resume_gives_every_stream_sample_once(streams, world_size, num_workers):
    read, state = save_two_by_two(streams, 3)
    per_rank = resume_onto(streams, state, world_size, num_workers)
    assert len({len(keys) for keys in per_rank}) == 1
    got = Counter(read + [k for keys in per_rank for k in keys])
    assert all(n == 1 for n in got.values()), [k for k, n in got.items() if n > 1]
    for info in streams:
        expected = stream_keys(info)
        mine = expected & set(got)
        assert set(got) - set().union(*(stream_keys(i) for i in streams)) == set()
        # The rest of each stream is cut in equal runs per rank: what does
        # not divide is dropped (remainder="drop"), nothing else.
        remaining = len(expected) - len(expected & set(read))
        assert len(expected) - len(mine) == remaining % world_size


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume_after_an_elastic_resume(streams, num_workers):
    """The epoch split anew by an elastic resume (with new weights) resumes
    exactly: its plan is recomputed from the states it was split from."""
    _, state = save_two_by_two(streams, 2)

    def loader() -> StatefulDataLoader:
        mix = make_mix(streams)
        mix.load_state_dict(state, weights=[0.4, 0.6])
        return StatefulDataLoader(
            mix,
            batch_size=4,
            num_workers=num_workers,
            collate_fn=collate_idents,
            timeout=120 if num_workers else 0,
        )

    reference = list(loader())
    first = loader()
    it = iter(first)
    before = [next(it) for _ in range(5)]
    saved = json.loads(json.dumps(first.state_dict()))
    del it
    assert all(s["generation"] == 1 and s["resumed_from"] for s in mix_states(saved))
    again = StatefulDataLoader(
        make_mix(streams, weights=(0.4, 0.6)),
        batch_size=4,
        num_workers=num_workers,
        collate_fn=collate_idents,
        timeout=120 if num_workers else 0,
    )
    again.load_state_dict(saved)
    assert before + list(again) == reference


def test_weights_changed_at_an_elastic_resume(streams):
    read, state = save_two_by_two(streams, 2)
    (after,) = resume_onto(streams, state, 1, 2, weights=[0.1, 0.9])
    got = Counter(read + after)
    assert all(n == 1 for n in got.values())
    assert set(got) == stream_keys(streams[0]) | stream_keys(streams[1])
    # The new weights lead: stream b comes first in most of the rest.
    head = after[: len(after) // 4]
    assert sum(k.startswith("b/") for k in head) > len(head) // 2


def test_an_elastic_state_missing_a_slot_is_refused(streams):
    _, state = save_two_by_two(streams, 1)
    state["slots"] = state["slots"][1:]
    mix = make_mix(streams)
    mix.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="every one of the 2 x 2 slots"):
        iter(mix)


def test_model_parallel_mixture_states_resume_elastically(streams):
    """4 ranks as 2 data-parallel groups of 2: the ranks of a group take the
    same samples and save the same states, which count once when gathered;
    the job resumes on one rank with every stream sample once."""
    read: dict[int, list[str]] = {}
    states = []
    for rank in range(4):
        datasets = [
            StreamingDataset(
                info.spec, seed=3, shuffle_buffer=5, rank=rank, world_size=4, model_parallel_size=2
            )
            for info in streams
        ]
        mix = Mix(datasets, [0.7, 0.3], policy="continue", seed=11)
        it = iter(mix)
        read[rank] = [ident(next(it)) for _ in range(9)]
        states.append(mix.state_dict())
        del it
    assert read[0] == read[1] and read[2] == read[3]
    assert not set(read[0]) & set(read[2])
    assert states[0] == states[1] and states[0]["world_size"] == 2
    (after,) = resume_onto(streams, elastic_state(*states), 1, 0)
    got = Counter(read[0] + read[2] + after)
    assert all(n == 1 for n in got.values())
    assert set(got) == stream_keys(streams[0]) | stream_keys(streams[1])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("format", "shardstream.state"),
        ("version", 2),
        ("epoch", -1),
        ("epoch", 2**40),
        ("generation", "1"),
        ("position", 10**9),
        ("position", None),
        ("finished", True),
        ("policy", "stop"),
        ("seed", 12),
        ("weights", [1.0]),
        ("weights", [-1.0, 2.0]),
        ("streams", []),
        ("streams", [{"pass": 0}, {"pass": 0}]),
        ("resumed_from", []),
        ("resumed_from", [{"format": "shardstream.mix"}]),
        ("rank", 1),
    ],
)
def test_a_damaged_mixture_state_is_refused_naming_its_field(streams, field, value):
    mix = make_mix(streams)
    it = iter(mix)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(mix.state_dict()))
    del it
    state[field] = value
    resumed = make_mix(streams)
    with pytest.raises(StateMismatchError, match=f"state field {field}"):
        resumed.load_state_dict(state)
        iter(resumed)


def test_a_state_of_another_kind_is_refused(streams):
    plain = StreamingDataset(streams[0].spec)
    for state in (plain.state_dict(), [1, 2], {"format": "shardstream.elastic", "slots": []}):
        with pytest.raises(StateMismatchError):
            make_mix(streams).load_state_dict(state)  # type: ignore[arg-type]


def test_a_damaged_stream_state_inside_a_mixture_is_refused(streams):
    mix = make_mix(streams)
    it = iter(mix)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(mix.state_dict()))
    del it
    state["streams"][1]["state"]["produced"] += 1
    resumed = make_mix(streams)
    resumed.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="produced"):
        iter(resumed)


def test_num_samples_is_what_each_rank_takes(streams):
    for num_workers in (1, 3):
        mix = make_mix(streams, policy="stop", rank=1, world_size=2)
        expected = sum(
            len(slot_keys(streams, (0.7, 0.3), "stop", 1, 2, w, num_workers))
            for w in range(num_workers)
        )
        assert mix.num_samples(num_workers) == expected


def test_a_shard_skipped_under_warn_leaves_a_gap_counted_in_the_state(tmp_path, streams):
    """A stream that gives fewer samples than its plan (the rest of a bad
    shard skipped under on_error="warn") leaves its places in the order
    empty: the others' samples all come, once, and the state counts the gap."""
    root = tmp_path / "c"
    info = write_uneven_dataset(root, (12, 12), prefix="c", seed=3)
    index_manifest([info.spec], root / "manifest.json")
    path = Path(info.paths[1])
    data = bytearray(path.read_bytes())
    offsets = member_offsets(bytes(data))
    header = sorted(offset for offset, _ in offsets.values())[10] - 512
    data[header : header + 100] = b"\xff" * 100  # a header whose checksum fails
    indexed = path.stat()
    path.write_bytes(bytes(data))
    # Damaged in place (bit rot): the manifest's record of it still holds.
    os.utime(path, ns=(indexed.st_atime_ns, indexed.st_mtime_ns))
    datasets = [
        StreamingDataset(info.spec, seed=3, shuffle_buffer=0, on_error="warn"),
        StreamingDataset(streams[1].spec, seed=3, shuffle_buffer=5),
    ]
    mix = Mix(datasets, [0.5, 0.5], policy="continue", seed=11)
    with pytest.warns(ShardSkippedWarning):
        keys = [ident(s) for s in collect(mix)]
    assert len(keys) == len(set(keys))
    assert {k for k in keys if k.startswith("b/")} == stream_keys(streams[1])
    got_c = [k for k in keys if k.startswith("c/")]
    assert 12 <= len(got_c) < 24
    state = mix.state_dict()
    assert state["finished"] and state["streams"][0]["short"] == 24 - len(got_c)
    assert state["streams"][1]["short"] == 0


def damaged_stream(root: Path) -> DatasetInfo:
    """Two shards of 12 samples, the second with a header whose checksum
    fails after its 10th sample: under on_error="warn" its rest is skipped."""
    info = write_uneven_dataset(root, (12, 12), prefix="c", seed=3)
    index_manifest([info.spec], root / "manifest.json")
    path = Path(info.paths[1])
    indexed = path.stat()
    data = bytearray(path.read_bytes())
    offsets = member_offsets(bytes(data))
    header = sorted(offset for offset, _ in offsets.values())[10] - 512
    data[header : header + 100] = b"\xff" * 100
    path.write_bytes(bytes(data))
    # Damaged in place, as the manifest knows it: the read meets the damage.
    os.utime(path, ns=(indexed.st_atime_ns, indexed.st_mtime_ns))
    return info


@pytest.mark.filterwarnings("ignore::shardstream.ShardSkippedWarning")
@pytest.mark.parametrize("policy", ["stop", "restart"])
def test_a_mixture_with_a_skipped_shard_resumes_from_every_position(tmp_path, streams, policy):
    """A stream without a shuffle buffer whose last shard was skipped under
    on_error="warn" ends after its last sample: a state saved at any
    position of the mixture, the positions after that stream ended
    included, resumes to exactly the rest."""
    info = damaged_stream(tmp_path / "c")

    def mix() -> Mix:
        datasets = [
            StreamingDataset(info.spec, seed=3, shuffle_buffer=0, on_error="warn"),
            StreamingDataset(streams[1].spec, seed=3, shuffle_buffer=5),
        ]
        return Mix(datasets, [0.5, 0.5], policy=policy, seed=11)

    reference = [ident(s) for s in collect(mix())]
    for stop in range(len(reference) + 1):
        it = iter(saved := mix())
        before = [ident(next(it)) for _ in range(stop)]
        state = json.loads(json.dumps(saved.state_dict()))
        del it
        resumed = mix()
        resumed.load_state_dict(state)
        assert before + [ident(s) for s in collect(resumed)] == reference, f"stop {stop}"


def test_num_samples_of_0_workers_is_that_of_the_main_process(streams):
    mix = make_mix(streams, policy="stop")
    assert mix.num_samples(0) == mix.num_samples(1) > 0
    with pytest.raises(ValueError, match=r"0 \(the main process reads\) or more"):
        mix.num_samples(-1)


def test_weights_needing_too_many_restarts_are_refused_when_the_epoch_starts(streams):
    mix = make_mix(streams, weights=(1.0, 1e5), policy="restart")
    with pytest.raises(ValueError, match="more than 1024 times"):
        iter(mix)


def test_a_stream_with_no_sample_for_a_worker_is_refused_under_restart(tmp_path):
    """Under ``"restart"`` a stream of fewer samples than the workers left
    some worker without it: before, that worker mixed the other stream
    alone, and 1:1 weights came out 60:40 at 3 workers (90 samples, not
    120), without a word. Now the epoch raises, naming ``weights``."""
    big = write_tar(tmp_path / "big.tar", [(f"b{i:03d}.txt", b"big") for i in range(60)])
    small = write_tar(tmp_path / "small.tar", [(f"s{i}.txt", b"small") for i in range(2)])

    def mix() -> Mix:
        datasets = [StreamingDataset(big, seed=1), StreamingDataset(small, seed=2)]
        return Mix(datasets, [1, 1], policy="restart")

    for workers in (0, 2):
        loader = torch.utils.data.DataLoader(mix(), batch_size=None, num_workers=workers)
        got = Counter(s["txt"] for s in loader)
        assert got == {b"big": 60, b"small": 60}
        assert mix().num_samples(workers) == 120
    with pytest.raises(ValueError, match="stream 1 has no sample for slot 2"):
        mix().num_samples(3)
    loader = torch.utils.data.DataLoader(mix(), batch_size=None, num_workers=3)
    with pytest.raises(ValueError, match="policy='continue'"):
        list(loader)


# --------------------------------------------------------------------------
# Each stream's transform
# --------------------------------------------------------------------------


def mark_a(sample: dict) -> tuple[str, str]:
    return ("A", ident(sample))


def mark_b(sample: dict) -> tuple[str, str]:
    return ("B", ident(sample))


def marked_loader(streams, num_workers: int, transforms) -> StatefulDataLoader:
    datasets = [
        StreamingDataset(info.spec, seed=3, shuffle_buffer=5, transform=transform)
        for info, transform in zip(streams, transforms, strict=True)
    ]
    mix = Mix(datasets, [0.7, 0.3], policy="continue", seed=11)
    mix.set_epoch(2)
    return StatefulDataLoader(
        mix,
        batch_size=4,
        num_workers=num_workers,
        collate_fn=list,
        timeout=120 if num_workers else 0,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_stream_s_transform_applies_inside_the_mixture_and_resume_stays_exact(
    streams, num_workers
):
    plain = [k for batch in mix_loader(streams, num_workers, "continue") for k in batch]
    reference = [
        x for batch in marked_loader(streams, num_workers, (mark_a, mark_b)) for x in batch
    ]
    # Each sample went through its own stream's transform, and the mixture
    # (which samples, in which order) is the one without transforms.
    assert [x[0] for x in reference] == [k[0].upper() for k in plain]
    assert [x[1] for x in reference] == plain
    # A stream without a transform gives its dicts beside a transformed one.
    mixed = [x for batch in marked_loader(streams, num_workers, (None, mark_b)) for x in batch]
    assert [ident(x) if isinstance(x, dict) else x for x in mixed] == [
        k if k.startswith("a/") else ("B", k) for k in plain
    ]
    for stop in (1, 5):
        loader = marked_loader(streams, num_workers, (mark_a, mark_b))
        it = iter(loader)
        before = [x for _ in range(stop) for x in next(it)]
        state = json.loads(json.dumps(loader.state_dict()))
        del it
        resumed = marked_loader(streams, num_workers, (mark_a, mark_b))
        resumed.load_state_dict(state)
        assert before + [x for batch in resumed for x in batch] == reference, f"stop {stop}"


def fails_on_first_shard(sample: dict) -> dict:
    if Path(sample["__url__"]).name == "a-000000.tar":
        raise KeyError("boom")
    return sample


def test_a_stream_s_transform_error_in_a_mixture_follows_its_on_error(streams):
    a, b = streams
    raising = [StreamingDataset(a.spec, transform=fails_on_first_shard), StreamingDataset(b.spec)]
    with pytest.raises(shardstream.TransformError, match="KeyError") as caught:
        collect(Mix(raising, policy="continue"))
    assert isinstance(caught.value.__cause__, KeyError)
    skipping = [
        StreamingDataset(a.spec, transform=fails_on_first_shard, on_error="warn"),
        StreamingDataset(b.spec),
    ]
    mix = Mix(skipping, policy="continue")
    with pytest.warns(shardstream.SampleSkippedWarning, match="transform raised"):
        keys = [ident(s) for s in collect(mix)]
    assert len(keys) == len(stream_keys(a)) + len(stream_keys(b)) - COUNTS_A[0]
    assert mix.stats()[0]["errors_skipped"] == COUNTS_A[0]


@pytest.mark.parametrize("state", [[], "shardstream.mix", None, 3, {"format": "shardstream.mix"}])
def test_a_state_that_is_not_a_mixture_state_is_a_state_mismatch(streams, state):
    mix = make_mix(streams)
    with pytest.raises(StateMismatchError):
        mix.load_state_dict(state)  # type: ignore[arg-type]


def test_a_num_workers_mismatch_through_stateful_dataloader_names_both_counts(streams):
    loader = mix_loader(streams, 2, "stop")
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    resumed = mix_loader(streams, 3, "stop")
    resumed.load_state_dict(state)
    with pytest.raises(StateMismatchError, match=r"num_workers=2.*num_workers=3"):
        list(resumed)


# --------------------------------------------------------------------------
# Weights at any scale
# --------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    weights=st.lists(st.floats(0.01, 100.0), min_size=2, max_size=4),
    available=st.lists(st.integers(0, 300), min_size=4, max_size=4),
    policy=st.sampled_from(["stop", "restart", "continue"]),
    exponent=st.integers(-1000, 1000),
)
def test_scaled_weights_give_the_same_mixture(weights, available, policy, exponent):
    available = available[: len(weights)]

    def plan(ws: list[float]) -> tuple[list[int], bytes]:
        counts = _core.mix_counts(policy, ws, available)
        return counts, _core.mix_order(policy, ws, counts, seed=3, epoch=1, slot=2)

    reference = plan(weights)
    # Powers of two keep the weights' ratios exactly: the same mixture,
    # also where the largest is near f64::MAX and their sum overflows.
    assert plan([math.ldexp(w, exponent) for w in weights]) == reference
    top = 1023 - math.frexp(max(weights))[1]
    assert plan([math.ldexp(w, top) for w in weights]) == reference


@pytest.mark.parametrize("policy", ["stop", "restart", "continue"])
def test_weights_that_overflow_mix_as_their_ratios(streams, policy):
    def counts(weights) -> Counter:
        mix = make_mix(streams, weights=weights, policy=policy)
        return Counter(ident(s).split("/")[0] for s in collect(mix))

    assert counts((1e308, 1e308)) == counts((1.0, 1.0))
    assert counts((1e308, 1e308 / 3)) == counts((3.0, 1.0))
    assert counts((5e-324, 5e-324)) == counts((1.0, 1.0))


def test_bad_weights_name_the_option(streams):
    a, b = streams
    ds = [StreamingDataset(a.spec), StreamingDataset(b.spec)]
    for weights in ([float("inf"), 1.0], [-1.0, 2.0], [0, 0], [10**400, 1]):
        with pytest.raises(ValueError, match="invalid option weights"):
            Mix(ds, weights)


def test_a_decode_key_matching_no_field_warns_once_per_stream_of_a_mixture(streams):
    import warnings

    datasets = [
        StreamingDataset(info.spec, decode={"text": "str", "cls": "int"}) for info in streams
    ]
    mix = Mix(datasets, policy="continue")
    with pytest.warns(shardstream.DecodeFieldWarning) as caught:
        first = collect(mix)
    messages = [str(w.message) for w in caught if w.category is shardstream.DecodeFieldWarning]
    assert len(messages) == 2
    assert {m.split("(shard ")[1].split("/")[-2] for m in messages} == {"a", "b"}
    assert all("decode key 'text'" in m and "'txt'" in m for m in messages)
    assert all(isinstance(s["cls"], int) for s in first)
    with warnings.catch_warnings():
        warnings.simplefilter("error", shardstream.DecodeFieldWarning)
        assert len(collect(mix)) == len(first)

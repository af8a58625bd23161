"""Property tests of the epoch plan (``_core.plan_epoch``) and of real streams
that follow it."""

from __future__ import annotations

import pytest
from _shardtest import assert_exactly_once, keys_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardstream
from shardstream import _core

U64 = st.integers(min_value=0, max_value=2**64 - 1)
SIZES = st.lists(st.one_of(st.none(), U64), max_size=80)
WORLD_SIZES = st.integers(min_value=1, max_value=8)
WORKER_COUNTS = st.integers(min_value=1, max_value=5)


def plan(sizes, *, seed=0, epoch=0, world_size=1, num_workers=1, shuffle_shards=True):
    return _core.plan_epoch(
        sizes,
        seed=seed,
        epoch=epoch,
        world_size=world_size,
        num_workers=num_workers,
        shuffle_shards=shuffle_shards,
    )


def effective_sizes(sizes):
    """Sizes as the planner weighs them: unknown sizes count as the mean
    known size (1 when none is known), and every shard as at least 1 byte."""
    known = [s for s in sizes if s is not None]
    fallback = sum(known) // len(known) if known else 1
    return [max(fallback if s is None else s, 1) for s in sizes]


def greedy_split(order, sizes, slot_count):
    """Reference split: shards in ``order``, each to the slot with the fewest
    (effective) bytes so far, the lowest slot on ties."""
    weights = effective_sizes(sizes)
    loads = [0] * slot_count
    slots: list[list[int]] = [[] for _ in range(slot_count)]
    for shard in order:
        slot = min(range(slot_count), key=lambda s: (loads[s], s))
        slots[slot].append(shard)
        loads[slot] += weights[shard]
    return slots


@given(sizes=SIZES, world_size=WORLD_SIZES, num_workers=WORKER_COUNTS, seed=U64, epoch=U64)
def test_every_shard_in_exactly_one_slot(sizes, world_size, num_workers, seed, epoch):
    slots = plan(sizes, seed=seed, epoch=epoch, world_size=world_size, num_workers=num_workers)
    assert len(slots) == world_size * num_workers
    placed = sorted(i for slot in slots for i in slot)
    assert placed == list(range(len(sizes)))


@given(
    sizes=SIZES,
    world_size=WORLD_SIZES,
    num_workers=WORKER_COUNTS,
    seed=U64,
    epoch=U64,
    shuffle=st.booleans(),
)
def test_deterministic(sizes, world_size, num_workers, seed, epoch, shuffle):
    kwargs = dict(
        seed=seed,
        epoch=epoch,
        world_size=world_size,
        num_workers=num_workers,
        shuffle_shards=shuffle,
    )
    assert plan(sizes, **kwargs) == plan(list(sizes), **kwargs)


@given(sizes=SIZES, world_size=WORLD_SIZES, num_workers=WORKER_COUNTS, seed=U64, epoch=U64)
def test_slots_balanced_by_bytes(sizes, world_size, num_workers, seed, epoch):
    """Each shard goes to the least loaded slot, so no slot ends more than
    one (largest) shard ahead of another."""
    slots = plan(sizes, seed=seed, epoch=epoch, world_size=world_size, num_workers=num_workers)
    weights = effective_sizes(sizes)
    loads = [sum(weights[i] for i in slot) for slot in slots]
    if weights:
        assert max(loads) - min(loads) <= max(weights)
    # Fewer shards than slots: no slot holds two while another is empty.
    if len(sizes) <= len(slots) and len(set(weights)) <= 1:
        assert all(len(slot) <= 1 for slot in slots)


@given(sizes=SIZES, world_size=WORLD_SIZES, num_workers=WORKER_COUNTS, seed=U64, epoch=U64)
def test_unshuffled_plan_is_greedy_in_listed_order(sizes, world_size, num_workers, seed, epoch):
    """Without shard shuffling the plan is independent of seed and epoch and
    equals a greedy assignment (least bytes, lowest slot on ties) in the
    listed order."""
    expected = greedy_split(range(len(sizes)), sizes, world_size * num_workers)
    got = plan(
        sizes,
        seed=seed,
        epoch=epoch,
        world_size=world_size,
        num_workers=num_workers,
        shuffle_shards=False,
    )
    assert got == expected


@settings(derandomize=True)  # a fixed set of examples: equal orders have odds 1/n!
@given(n=st.integers(min_value=8, max_value=300), seed=U64, epoch=st.integers(0, 2**63))
def test_epochs_differ(n, seed, epoch):
    sizes = [100] * n
    a = plan(sizes, seed=seed, epoch=epoch)
    b = plan(sizes, seed=seed, epoch=epoch + 1)
    assert sorted(a[0]) == sorted(b[0]) == list(range(n))
    assert a != b


@settings(derandomize=True)
@given(n=st.integers(min_value=8, max_value=300), seed=st.integers(0, 2**63), epoch=U64)
def test_seeds_differ(n, seed, epoch):
    sizes = [100] * n
    assert plan(sizes, seed=seed, epoch=epoch) != plan(sizes, seed=seed + 1, epoch=epoch)


@given(sizes=SIZES, world_size=WORLD_SIZES, num_workers=WORKER_COUNTS, seed=U64, epoch=U64)
def test_shuffled_plan_splits_the_epoch_order(sizes, world_size, num_workers, seed, epoch):
    """The epoch's shard order depends on (seed, epoch) only -- it is the plan
    of a single slot -- and every layout splits that same order greedily."""
    (order,) = plan(sizes, seed=seed, epoch=epoch)
    assert sorted(order) == list(range(len(sizes)))
    got = plan(sizes, seed=seed, epoch=epoch, world_size=world_size, num_workers=num_workers)
    assert got == greedy_split(order, sizes, world_size * num_workers)


@pytest.mark.parametrize(("world_size", "num_workers"), [(0, 1), (1, 0), (0, 0)])
def test_invalid_slot_counts(world_size, num_workers):
    with pytest.raises(ValueError):
        plan([1, 2, 3], world_size=world_size, num_workers=num_workers)


def test_exported_plan_epoch_is_the_core_one():
    assert shardstream.plan_epoch is _core.plan_epoch


# --------------------------------------------------------------------------
# Real streams follow the plan.
# --------------------------------------------------------------------------


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    # Plans by bytes are for one rank: several ranks need sample counts
    # (tests/python/test_dataloader.py checks those plans).
    world_size=st.just(1),
    num_workers=st.integers(1, 6),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 1000),
    shuffle_buffer=st.sampled_from([0, 1, 5, 1000]),
)
def test_every_slot_streams_its_planned_shards(
    dataset, world_size, num_workers, seed, epoch, shuffle_buffer
):
    slots = plan(
        dataset.sizes, seed=seed, epoch=epoch, world_size=world_size, num_workers=num_workers
    )
    everything = []
    for slot, shard_indices in enumerate(slots):
        ds = shardstream.StreamingDataset(
            dataset.spec,
            seed=seed,
            shuffle_buffer=shuffle_buffer,
            rank=slot // num_workers,
            world_size=world_size,
            num_workers=num_workers,
            worker_id=slot % num_workers,
            count_samples=False,
        )
        ds.set_epoch(epoch)
        samples = list(ds)
        keys = keys_of(samples)
        planned_urls = [dataset.urls[i] for i in shard_indices]
        assert sorted(keys) == sorted(dataset.keys_of(planned_urls))
        assert {s["__url__"] for s in samples} == set(planned_urls)
        if shuffle_buffer <= 1:
            # No sample shuffle: shards in plan order, samples in file order.
            assert keys == [k for url in planned_urls for k in dataset.keys_of([url])]
        everything += keys
    assert_exactly_once(everything, dataset.keys)

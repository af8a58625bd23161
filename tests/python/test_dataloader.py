"""StreamingDataset through a real torch DataLoader: coverage, content,
determinism, epochs and the rank/worker split."""

from __future__ import annotations

import pytest
from _shardtest import assert_exactly_once, keys_of, loader, sample_digest

import shardstream
from shardstream import _core

WORKER_COUNTS = [0, 1, 2, 4]

# 4 workers on a 2-core machine is deliberate here.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def epoch_samples(spec, num_workers, *, epoch=0, **kwargs):
    ds = shardstream.StreamingDataset(spec, **kwargs)
    ds.set_epoch(epoch)
    return list(loader(ds, num_workers))


@pytest.mark.parametrize("num_workers", WORKER_COUNTS)
def test_one_epoch_yields_every_sample_once_with_its_bytes(dataset, num_workers):
    samples = epoch_samples(dataset.spec, num_workers, seed=11)
    assert_exactly_once(keys_of(samples), dataset.keys)
    assert len(samples) == len(dataset.samples)
    expected = dataset.by_key()
    for sample in samples:
        want = expected[sample["__key__"]]
        assert sample["__url__"] == want.url
        assert sample_digest(sample) == want.digest(), sample["__key__"]
        assert set(sample) == {"__key__", "__url__", *want.fields}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_same_seed_and_epoch_give_the_same_order(dataset, num_workers):
    first = keys_of(epoch_samples(dataset.spec, num_workers, seed=5, epoch=3))
    second = keys_of(epoch_samples(dataset.spec, num_workers, seed=5, epoch=3))
    assert first == second
    assert_exactly_once(first, dataset.keys)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_different_epochs_give_different_orders(dataset, num_workers):
    orders = [keys_of(epoch_samples(dataset.spec, num_workers, epoch=e)) for e in range(3)]
    for order in orders:
        assert_exactly_once(order, dataset.keys)
    assert orders[0] != orders[1]
    assert orders[1] != orders[2]
    assert orders[0] != orders[2]


def test_different_seeds_give_different_orders(dataset):
    a = keys_of(epoch_samples(dataset.spec, 0, seed=1))
    b = keys_of(epoch_samples(dataset.spec, 0, seed=2))
    assert sorted(a) == sorted(b)
    assert a != b


def test_set_epoch_between_dataloader_epochs(dataset):
    ds = shardstream.StreamingDataset(dataset.spec, seed=9)
    dl = loader(ds, 2)
    per_epoch = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        per_epoch.append(keys_of(dl))
    for epoch, order in enumerate(per_epoch):
        assert_exactly_once(order, dataset.keys)
        # The same epoch on a fresh dataset reproduces the order.
        assert order == keys_of(epoch_samples(dataset.spec, 2, seed=9, epoch=epoch))
    assert per_epoch[0] != per_epoch[1] != per_epoch[2]


def test_dataloader_workers_stream_their_plan_slots(dataset):
    """Each worker's stream is a slot of the plan: with explicit worker ids,
    iterating the slots in the main process gives the same per-slot samples
    that a DataLoader with that many workers interleaves."""
    ds = shardstream.StreamingDataset(dataset.spec, seed=4)
    via_loader = keys_of(loader(ds, 2))
    slots = [
        keys_of(shardstream.StreamingDataset(dataset.spec, seed=4, num_workers=2, worker_id=w))
        for w in range(2)
    ]
    # The DataLoader takes one sample from each worker in turn.
    expected = []
    for i in range(max(map(len, slots))):
        expected += [slot[i] for slot in slots if i < len(slot)]
    assert sorted(via_loader) == sorted(expected)
    assert_exactly_once(via_loader, dataset.keys)
    if len(slots[0]) == len(slots[1]):
        assert via_loader == expected


def test_no_shuffle_gives_file_order(dataset):
    got = epoch_samples(dataset.spec, 0, shuffle_shards=False, shuffle_buffer=0)
    assert keys_of(got) == dataset.keys
    assert [s["__url__"] for s in got] == [s.url for s in dataset.samples]
    # Same again on another epoch and seed: nothing is random.
    again = epoch_samples(dataset.spec, 0, shuffle_shards=False, shuffle_buffer=0, seed=3, epoch=7)
    assert keys_of(again) == dataset.keys


def test_no_shuffle_per_worker_follows_the_plan(dataset):
    plan = _core.plan_epoch(
        dataset.sizes, seed=0, epoch=0, world_size=1, num_workers=3, shuffle_shards=False
    )
    for worker, shard_indices in enumerate(plan):
        ds = shardstream.StreamingDataset(
            dataset.spec,
            shuffle_shards=False,
            shuffle_buffer=0,
            num_workers=3,
            worker_id=worker,
            count_samples=False,
        )
        expected = [k for i in shard_indices for k in dataset.keys_of([dataset.urls[i]])]
        assert keys_of(ds) == expected


def test_shard_shuffle_only_keeps_each_shard_contiguous(dataset):
    got = epoch_samples(dataset.spec, 0, shuffle_shards=True, shuffle_buffer=0, seed=21, epoch=1)
    urls = [s["__url__"] for s in got]
    runs = [u for i, u in enumerate(urls) if i == 0 or urls[i - 1] != u]
    assert sorted(runs) == sorted(dataset.urls), "each shard must be read as one run"
    plan = _core.plan_epoch(dataset.sizes, seed=21, epoch=1, world_size=1, num_workers=1)
    assert runs == [dataset.urls[i] for i in plan[0]]
    for url in dataset.urls:
        assert [s["__key__"] for s in got if s["__url__"] == url] == dataset.keys_of([url])


def test_shuffle_buffer_shuffles_within_its_bound(dataset):
    file_order = {k: i for i, k in enumerate(dataset.keys)}
    buffer = 4
    got = keys_of(epoch_samples(dataset.spec, 0, shuffle_shards=False, shuffle_buffer=buffer))
    assert_exactly_once(got, dataset.keys)
    assert got != dataset.keys
    # A buffer of B samples can only emit one of the next B not-yet-emitted
    # samples: output position k holds an input at most k + B - 1.
    for position, key in enumerate(got):
        assert file_order[key] <= position + buffer - 1, (position, key)


def test_shuffle_buffer_ramps_up_from_shuffle_initial(dataset):
    file_order = {k: i for i, k in enumerate(dataset.keys)}
    buffer, initial = 16, 4
    assert len(dataset.keys) > 2 * buffer
    got = keys_of(
        epoch_samples(
            dataset.spec, 0, shuffle_shards=False, shuffle_buffer=buffer, shuffle_initial=initial
        )
    )
    assert_exactly_once(got, dataset.keys)
    # The buffer emits its first sample once it holds `initial` and grows by
    # one per sample out: output k is one of the first initial + 2k inputs,
    # and never beyond what a full buffer allows.
    for position, key in enumerate(got):
        assert file_order[key] <= min(initial + 2 * position, position + buffer) - 1, (
            position,
            key,
        )
    ahead = [file_order[key] - position for position, key in enumerate(got)]
    assert max(ahead) >= initial, "the buffer never grew past shuffle_initial"


@pytest.mark.parametrize("kwargs", [{"shuffle_buffer": 1}, {"shuffle_buffer_bytes": 1}])
def test_degenerate_shuffle_buffer_keeps_file_order(dataset, kwargs):
    got = epoch_samples(dataset.spec, 0, shuffle_shards=False, **kwargs)
    assert keys_of(got) == dataset.keys


def test_small_read_ahead_budget(dataset):
    got = epoch_samples(dataset.spec, 2, read_ahead_bytes=4096, seed=2)
    assert_exactly_once(keys_of(got), dataset.keys)
    expected = dataset.by_key()
    for sample in got:
        assert sample_digest(sample) == expected[sample["__key__"]].digest()


def test_stats_are_shared_with_forked_workers(dataset):
    # Whole shards (no sample counts), so every byte of every file is read.
    ds = shardstream.StreamingDataset(dataset.spec, seed=1, count_samples=False)
    got = keys_of(loader(ds, 2, multiprocessing_context="fork"))
    assert_exactly_once(got, dataset.keys)
    stats = ds.stats()
    assert stats["samples"] == len(dataset.samples)
    assert stats["bytes_read"] == sum(dataset.sizes)
    assert stats["shards_completed"] == len(dataset.paths)
    assert stats["shards_opened"] == len(dataset.paths)
    assert stats["errors_skipped"] == 0


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_non_fork_worker_start_methods(dataset, context):
    """Workers that get a pickled copy of the dataset still split it."""
    ds = shardstream.StreamingDataset(dataset.spec, seed=12)
    got = loader(ds, 2, multiprocessing_context=context)
    samples = list(got)
    assert_exactly_once(keys_of(samples), dataset.keys)
    expected = dataset.by_key()
    for sample in samples:
        assert sample_digest(sample) == expected[sample["__key__"]].digest()
    # The same order as with forked workers: the plan and shuffle do not
    # depend on how workers start.
    forked = keys_of(loader(shardstream.StreamingDataset(dataset.spec, seed=12), 2))
    assert keys_of(samples) == forked


@pytest.mark.parametrize("num_workers", [0, 2])
def test_explicit_ranks_partition_the_dataset(dataset, num_workers):
    world_size = 3
    per_rank = []
    for rank in range(world_size):
        samples = epoch_samples(
            dataset.spec, num_workers, rank=rank, world_size=world_size, seed=6, epoch=2
        )
        per_rank.append(keys_of(samples))
    for i in range(world_size):
        for j in range(i + 1, world_size):
            assert not set(per_rank[i]) & set(per_rank[j]), (i, j)
    assert_exactly_once([k for keys in per_rank for k in keys], dataset.keys)
    # The shards are counted from their headers: each rank reads the sample
    # runs of its slots in the plan, and every rank as many samples.
    counts = [len(dataset.keys_of([url])) for url in dataset.urls]
    k = max(num_workers, 1)
    plan = _core.plan_samples(counts, seed=6, epoch=2, world_size=world_size, num_workers=k)
    for rank, keys in enumerate(per_rank):
        runs = [run for slot in plan[rank * k : (rank + 1) * k] for run in slot]
        expected = [
            key
            for shard, start, end in runs
            for key in dataset.keys_of([dataset.urls[shard]])[start:end]
        ]
        assert sorted(keys) == sorted(expected)
    assert {len(keys) for keys in per_rank} == {len(dataset.keys) // world_size}


def test_fewer_shards_than_slots(small_dataset):
    world_size, num_workers = 2, 4
    assert len(small_dataset.paths) < world_size * num_workers
    got = []
    for rank in range(world_size):
        got += keys_of(
            epoch_samples(small_dataset.spec, num_workers, rank=rank, world_size=world_size)
        )
    assert_exactly_once(got, small_dataset.keys)


def test_fewer_shards_than_slots_empty_slots_iterate_nothing(small_dataset):
    """Whole shards dealt by bytes (no counts, one rank): slots beyond the
    shard count get none."""
    world_size, num_workers = 1, 6
    plan = _core.plan_epoch(
        small_dataset.sizes, seed=0, epoch=0, world_size=world_size, num_workers=num_workers
    )
    empty = 0
    got = []
    for slot, shard_indices in enumerate(plan):
        ds = shardstream.StreamingDataset(
            small_dataset.spec,
            rank=slot // num_workers,
            world_size=world_size,
            num_workers=num_workers,
            worker_id=slot % num_workers,
            count_samples=False,
        )
        keys = keys_of(ds)
        if not shard_indices:
            empty += 1
            assert keys == []
            assert ds.stats()["shards_opened"] == 0
        got += keys
    assert empty == world_size * num_workers - len(small_dataset.paths)
    assert_exactly_once(got, small_dataset.keys)


def test_more_workers_than_shards_in_dataloader(small_dataset):
    got = keys_of(epoch_samples(small_dataset.spec, 4))
    assert_exactly_once(got, small_dataset.keys)


def test_early_break_then_full_epoch(dataset):
    ds = shardstream.StreamingDataset(dataset.spec, seed=8)
    dl = loader(ds, 2)
    for i, _ in enumerate(dl):
        if i == 5:
            break
    assert_exactly_once(keys_of(dl), dataset.keys)

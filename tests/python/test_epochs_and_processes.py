"""Epochs that advance by themselves (in the main process, in forked,
persistent and spawned DataLoader workers), what a pickled dataset (a
spawned worker's) plans over, iterators used across a fork, and how samples
pickle in a DataLoader worker."""

from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _shardtest import assert_exactly_once, collect, keys_of, loader, write_tar
from torch.utils.data import DataLoader

import shardstream
from shardstream import DatasetSpecError, StreamProcessError, _core

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

SEED = 9


def epoch_order(spec, num_workers: int, epoch: int, **kwargs) -> list[str]:
    """The order of one epoch, on a fresh dataset told its epoch."""
    ds = shardstream.StreamingDataset(spec, seed=SEED, **kwargs)
    ds.set_epoch(epoch)
    return keys_of(collect(loader(ds, num_workers)))


def write_shard(path: Path, prefix: str, count: int) -> Path:
    return write_tar(
        path, [(f"{prefix}{i:03d}.txt", f"{prefix} {i}".encode()) for i in range(count)]
    )


# --------------------------------------------------------------------------
# Epochs advance by themselves
# --------------------------------------------------------------------------

LAYOUTS = [(0, False), (2, False), (2, True)]
LAYOUT_IDS = ["in-process", "2-workers", "2-persistent-workers"]


@pytest.mark.parametrize(("num_workers", "persistent"), LAYOUTS, ids=LAYOUT_IDS)
def test_each_new_iteration_takes_the_next_epoch(dataset, num_workers, persistent):
    ds = shardstream.StreamingDataset(dataset.spec, seed=SEED)
    kwargs = {"persistent_workers": True} if persistent else {}
    dl = loader(ds, num_workers, **kwargs)
    orders = [keys_of(collect(dl)) for _ in range(3)]
    for order in orders:
        assert_exactly_once(order, dataset.keys)
    assert len({tuple(order) for order in orders}) == 3, "an epoch came twice"
    for epoch, order in enumerate(orders):
        assert order == epoch_order(dataset.spec, num_workers, epoch)
    assert ds.epoch == 3


@pytest.mark.parametrize(("num_workers", "persistent"), LAYOUTS, ids=LAYOUT_IDS)
def test_set_epoch_sets_the_next_iteration_and_the_following_go_on(
    dataset, num_workers, persistent
):
    ds = shardstream.StreamingDataset(dataset.spec, seed=SEED)
    kwargs = {"persistent_workers": True} if persistent else {}
    dl = loader(ds, num_workers, **kwargs)
    first = keys_of(collect(dl))
    ds.set_epoch(5)
    assert ds.epoch == 5
    fifth, sixth = keys_of(collect(dl)), keys_of(collect(dl))
    assert fifth == epoch_order(dataset.spec, num_workers, 5)
    assert sixth == epoch_order(dataset.spec, num_workers, 6)
    # Going back is explicit too, persistent workers included.
    ds.set_epoch(0)
    assert keys_of(collect(dl)) == first
    assert ds.epoch == 1


def test_a_persistent_worker_starts_reading_the_next_epoch_when_its_own_ends(dataset):
    """Once a persistent worker's epoch ends, its next epoch's stream is
    opened and read while the training loop is still between epochs: more
    than one epoch's bytes are read before the next iteration asks. That
    iteration takes the stream, and the epochs stay the ones a fresh
    dataset told its epoch streams (the set_epoch test above covers a
    started stream that set_epoch makes the wrong one)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    one_epoch = sum(p.stat().st_size for p in dataset.paths)
    ds = shardstream.StreamingDataset(dataset.spec, seed=SEED)
    dl = StatefulDataLoader(
        ds, batch_size=None, num_workers=2, persistent_workers=True, timeout=120
    )
    assert keys_of(collect(dl)) == epoch_order(dataset.spec, 2, 0)
    deadline = time.monotonic() + 10
    while ds.stats()["bytes_read"] <= one_epoch and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ds.stats()["bytes_read"] > one_epoch, "no read of the next epoch began"
    # Samples count as they reach the iteration: none of the next epoch yet.
    assert ds.stats()["samples"] == len(dataset.keys)
    # The started stream's state is exact: resume epoch 1 after 5 samples.
    iterator = iter(dl)
    first = keys_of([next(iterator) for _ in range(5)])
    state = dl.state_dict()
    rest = keys_of(list(iterator))
    assert first + rest == epoch_order(dataset.spec, 2, 1)
    resumed = StatefulDataLoader(
        shardstream.StreamingDataset(dataset.spec, seed=SEED), batch_size=None, num_workers=2
    )
    resumed.load_state_dict(state)
    assert keys_of(collect(resumed)) == rest


def test_the_main_process_starts_the_next_epoch_from_its_second_epoch_on(dataset):
    """A process that is no DataLoader worker cannot tell a single pass
    from a loop over epochs: its first epoch's end starts nothing; from its
    second iteration on, each end starts the next epoch's reads, which the
    next iteration takes (the epochs those of a fresh dataset told its
    epoch), and a checkpoint inside a started epoch resumes exactly."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    one_epoch = sum(p.stat().st_size for p in dataset.paths)
    ds = shardstream.StreamingDataset(dataset.spec, seed=SEED)
    dl = StatefulDataLoader(ds, batch_size=None, num_workers=0)
    assert keys_of(collect(dl)) == epoch_order(dataset.spec, 0, 0)
    assert ds._next_stream is None, "a single pass started the next epoch"
    time.sleep(0.2)
    assert ds.stats()["bytes_read"] == one_epoch
    assert keys_of(collect(dl)) == epoch_order(dataset.spec, 0, 1)
    assert ds._next_stream is not None, "the second epoch's end started nothing"
    started = ds._next_stream[1]
    assert started.epoch == 2 and started.started
    deadline = time.monotonic() + 10
    while ds.stats()["bytes_read"] <= 2 * one_epoch and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ds.stats()["bytes_read"] > 2 * one_epoch, "no read of the next epoch began"
    iterator = iter(dl)
    first = keys_of([next(iterator) for _ in range(5)])
    assert ds._stream is started
    state = dl.state_dict()
    rest = keys_of(list(iterator))
    assert first + rest == epoch_order(dataset.spec, 0, 2)
    # The epoch after goes on from the started one, itself started early.
    assert ds._next_stream is not None and ds._next_stream[1].epoch == 3
    assert keys_of(collect(dl)) == epoch_order(dataset.spec, 0, 3)
    resumed = StatefulDataLoader(
        shardstream.StreamingDataset(dataset.spec, seed=SEED), batch_size=None, num_workers=0
    )
    resumed.load_state_dict(state)
    assert keys_of(collect(resumed)) == rest
    # Off: no epoch starts before its iteration, however many came before.
    off = shardstream.StreamingDataset(dataset.spec, seed=SEED, read_next_epoch_early=False)
    for epoch in range(3):
        assert keys_of(collect(off)) == epoch_order(dataset.spec, 0, epoch)
        assert off._next_stream is None


@pytest.mark.parametrize("mixed", [False, True], ids=["dataset", "mix"])
def test_an_iteration_left_before_its_end_is_not_the_one_in_progress(dataset, mixed):
    """``set_epoch`` with the epoch of an iterator being read leaves it be
    (the frameworks that call it once the epoch's iterator exists): once it
    has ended, the next iteration streams the epoch after; if the next
    iteration begins before (the iterator was left early), it streams the
    epoch from its start."""

    def make():
        ds = shardstream.StreamingDataset(dataset.spec, seed=SEED)
        return shardstream.Mix([ds], [1.0]) if mixed else ds

    def whole(epoch):
        fresh = make()
        fresh.set_epoch(epoch)
        return keys_of(collect(fresh))

    ds = make()
    held = iter(ds)
    first = keys_of([next(held) for _ in range(5)])
    ds.set_epoch(0)
    assert first + keys_of(collect(held)) == whole(0)
    assert keys_of(collect(ds)) == whole(1)

    left = iter(ds)
    assert keys_of([next(left) for _ in range(5)]) == whole(2)[:5]
    ds.set_epoch(2)
    # A new pass begins before the one left has ended: epoch 2 again.
    assert keys_of(collect(ds)) == whole(2)
    assert keys_of(collect(ds)) == whole(3)


def test_read_next_epoch_early_false_opens_each_epoch_at_its_iteration(dataset):
    one_epoch = sum(p.stat().st_size for p in dataset.paths)
    ds = shardstream.StreamingDataset(dataset.spec, seed=SEED, read_next_epoch_early=False)
    dl = loader(ds, 2, persistent_workers=True)
    assert keys_of(collect(dl)) == epoch_order(dataset.spec, 2, 0)
    time.sleep(0.5)
    assert ds.stats()["bytes_read"] == one_epoch
    assert keys_of(collect(dl)) == epoch_order(dataset.spec, 2, 1)


def test_the_next_iteration_takes_the_started_stream_only_if_it_would_open_it(dataset):
    """The stream started at an epoch's end is the next iteration's only if
    that iteration would open the same: not after ``set_epoch`` to another
    epoch, nor with a loaded state pending; either way the order is the
    epoch's own."""
    ds = shardstream.StreamingDataset(dataset.spec, seed=SEED)
    assert keys_of(collect(ds)) == epoch_order(dataset.spec, 0, 0)
    ds._start_next()
    started = ds._next_stream[1]
    iterator = iter(ds)
    assert ds._stream is started
    assert keys_of(collect(iterator)) == epoch_order(dataset.spec, 0, 1)

    ds._start_next()
    started = ds._next_stream[1]
    ds.set_epoch(7)
    iterator = iter(ds)
    assert ds._stream is not started
    assert keys_of(collect(iterator)) == epoch_order(dataset.spec, 0, 7)

    iterator = iter(ds)
    first = keys_of([next(iterator) for _ in range(5)])
    state = ds.state_dict()
    rest = keys_of(collect(iterator))
    assert first + rest == epoch_order(dataset.spec, 0, 8)
    ds._start_next()
    started = ds._next_stream[1]
    ds.load_state_dict(state)
    iterator = iter(ds)
    assert ds._stream is not started
    assert keys_of(collect(iterator)) == rest


def test_an_epoch_ends_whatever_its_end_callback_raises(dataset):
    """``on_end`` runs once at the stream's end; what it raises is reported
    as unraisable and the stream still ends. After a failure it does not run."""
    calls = []
    reported = []

    def on_end():
        calls.append(1)
        raise RuntimeError("from on_end")

    ds = shardstream.StreamingDataset(dataset.spec, seed=SEED)
    stream = _core.SampleStream(ds.shard_list, on_end=on_end)
    hook = sys.unraisablehook
    sys.unraisablehook = reported.append
    try:
        assert len(list(stream)) == len(dataset.keys)
        assert next(stream, None) is None
    finally:
        sys.unraisablehook = hook
    assert calls == [1]
    assert [str(r.exc_value) for r in reported] == ["from on_end"]


def test_the_end_callback_runs_as_the_short_last_batch_is_handed_out(dataset):
    """With batches, the ``next()`` that finds the end while it collects
    (the last batch short of ``batch_size``) calls ``on_end`` before it
    hands that batch out, a call sooner than the ``StopIteration``: the
    next epoch's reads start while the last batch is trained on."""
    n = len(dataset.keys)
    size = next(k for k in range(5, n) if n % k)  # the last batch is short
    calls = []
    ds = shardstream.StreamingDataset(dataset.spec, seed=SEED, batch_size=size)
    stream = _core.SampleStream(ds.shard_list, on_end=lambda: calls.append(1))
    seen = 0
    for batch in stream:
        seen += len(batch["__key__"])
        assert calls == ([1] if seen == n else []), seen
    assert seen == n and calls == [1]


def test_an_interrupt_in_the_end_callback_goes_on(dataset):
    def on_end():
        raise KeyboardInterrupt

    ds = shardstream.StreamingDataset(dataset.spec, seed=SEED)
    stream = _core.SampleStream(ds.shard_list, on_end=on_end)
    with pytest.raises(KeyboardInterrupt):
        for _ in stream:
            pass


def test_a_failed_stream_does_not_call_its_end_callback(tmp_path):
    path = tmp_path / "bad.tar"
    path.write_bytes(b"not a tar header" * 64)
    calls = []
    ds = shardstream.StreamingDataset(str(path))
    stream = _core.SampleStream(ds.shard_list, on_end=lambda: calls.append(1))
    with pytest.raises(shardstream.ShardStreamError):
        next(stream)
    assert next(stream, None) is None
    assert calls == []


def test_a_stream_started_before_its_iteration_counts_no_wait_before_it(tmp_path):
    """A stream started early (the next epoch's, in a persistent worker)
    fills its queue and waits for its consumer: that wait is not the
    consumer being slow, and neither it nor the pipeline's time counts."""
    for count in (1000, 256):  # 256: the last wait is the end's
        path = write_tar(tmp_path / f"{count}.tar", [(f"k{i:05d}.txt", b"x") for i in range(count)])
        ds = shardstream.StreamingDataset(str(path), shuffle_buffer=0)
        ds._start_next()
        time.sleep(1.0)
        assert sum(1 for _ in iter(ds)) == count
        stats = ds.stats()
        assert stats["output_wait_ns"] < 0.5e9, (count, stats)
        assert stats["pipeline_ns"] < 0.5e9, (count, stats)


def test_dataloaders_with_other_worker_counts_agree_on_the_epoch(dataset):
    """Each worker advances its own entry; a later DataLoader with more
    workers (or the main process) goes on from the same epoch, so its
    workers never mix two epochs' plans."""
    ds = shardstream.StreamingDataset(dataset.spec, seed=SEED)
    assert keys_of(collect(loader(ds, 2))) == epoch_order(dataset.spec, 2, 0)
    assert keys_of(collect(loader(ds, 4))) == epoch_order(dataset.spec, 4, 1)
    assert keys_of(collect(ds)) == epoch_order(dataset.spec, 0, 2)
    assert keys_of(collect(loader(ds, 3))) == epoch_order(dataset.spec, 3, 3)
    assert ds.epoch == 4


def test_a_state_loaded_after_persistent_workers_were_made_is_refused_in_them(dataset):
    """Persistent workers hold the dataset as it was when they were made:
    a state loaded in the main process after that is not theirs to
    resume. Before, they streamed the state's epoch from its start (its
    first samples again) with no error; now the iteration raises, naming
    the fix. Loaded before the DataLoader is made, it resumes (counted
    shards: the state of one slot is resumed by two)."""
    reader = shardstream.StreamingDataset(dataset.spec, seed=SEED, count_samples=True)
    reader.set_epoch(1)
    iterator = iter(reader)
    first = keys_of([next(iterator) for _ in range(7)])
    state = shardstream.elastic_state(reader.state_dict())
    del iterator
    ds = shardstream.StreamingDataset(dataset.spec, seed=SEED, count_samples=True)
    dl = loader(ds, 2, persistent_workers=True)
    # A sample from each worker: both have begun iterating (a worker whose
    # first iteration meets the state raises as it starts, and dies).
    running = iter(dl)
    assert len(keys_of([next(running), next(running)])) == 2
    del running
    ds.load_state_dict(state)
    with pytest.raises(shardstream.ShardStreamError, match="load the state before making"):
        collect(dl)
    fresh = shardstream.StreamingDataset(dataset.spec, seed=SEED, count_samples=True)
    fresh.load_state_dict(state)
    rest = keys_of(collect(loader(fresh, 2)))
    assert_exactly_once(first + rest, dataset.keys)


def test_a_plain_pickle_copies_the_epoch_without_sharing_it(dataset):
    ds = shardstream.StreamingDataset(dataset.spec, seed=SEED)
    ds.set_epoch(4)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.epoch == 4
    assert keys_of(collect(clone)) == epoch_order(dataset.spec, 0, 4)
    assert clone.epoch == 5 and ds.epoch == 4


def advance(table, worker: int, num_workers: int, epoch: int) -> None:
    table.set_worker(worker, num_workers, epoch)


def test_a_forkserver_process_advances_the_same_epochs():
    """``multiprocessing`` hands a process it starts the table's memory (as
    with a DataLoader's ``forkserver`` workers), not a copy."""
    import multiprocessing

    import shardstream.dataset  # noqa: F401  (registers the hand-off)

    table = _core.EpochTable()
    table.set_all(3)
    process = multiprocessing.get_context("forkserver").Process(
        target=advance, args=(table, 1, 2, 7)
    )
    process.start()
    process.join(60)
    assert process.exitcode == 0
    assert table.values()[:4] == [3, 7, 7, 7]


def reweight(weights, new: list[float]) -> None:
    assert weights.get(0) == [1.0, 2.0]
    weights.set(new, 2)


def test_a_forkserver_process_sees_and_sets_the_same_mixture_weights():
    """A mixture's weights reach a process ``multiprocessing`` starts (a
    persistent ``forkserver`` worker) as shared memory, both ways."""
    import multiprocessing

    import shardstream.mix  # noqa: F401  (registers the hand-off)

    weights = _core.SharedWeights([1.0, 2.0])
    process = multiprocessing.get_context("forkserver").Process(
        target=reweight, args=(weights, [0.5, 8.0])
    )
    process.start()
    process.join(60)
    assert process.exitcode == 0
    # From epoch 2 on; the epochs before keep theirs.
    assert [weights.get(e) for e in (1, 2, 9)] == [[1.0, 2.0], [0.5, 8.0], [0.5, 8.0]]
    # Plain pickling gives an unshared copy, epochs and all.
    copy = pickle.loads(pickle.dumps(weights))
    assert [copy.get(e) for e in (1, 2)] == [[1.0, 2.0], [0.5, 8.0]]
    copy.set([3.0, 3.0], 0)
    assert (copy.get(1), weights.get(1)) == ([3.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="at most 255 weights"):
        _core.SharedWeights([1.0] * 256)
    with pytest.raises(ValueError, match="not a weights table"):
        _core.SharedWeights._attach(os.open(os.devnull, os.O_RDONLY))


def test_epoch_table_refuses_what_it_cannot_hold():
    table = _core.EpochTable()
    with pytest.raises(ValueError, match="at most 1024 workers"):
        table.get(_core.EpochTable.capacity)
    with pytest.raises(ValueError, match="worker 2 of a DataLoader of 2"):
        table.set_worker(2, 2, 1)
    with pytest.raises(ValueError, match="not an epoch table"):
        _core.EpochTable._attach(os.open(os.devnull, os.O_RDONLY))


# --------------------------------------------------------------------------
# A pickled dataset plans over the shards resolved when it was made
# --------------------------------------------------------------------------


def test_spawned_workers_use_the_main_process_shards_and_epochs(tmp_path):
    """Workers started with ``spawn`` get the shard list the main process
    resolved (a shard added to the directory afterwards is not read) and
    advance the main process's epochs: two epochs, two orders."""
    import multiprocessing

    shards = [write_shard(tmp_path / f"shard-{n}.tar", f"s{n}-", 6) for n in range(4)]
    expected = [f"s{n}-{i:03d}" for n in range(4) for i in range(6)]
    ds = shardstream.StreamingDataset(str(tmp_path), seed=SEED, shuffle_buffer=5)
    write_shard(tmp_path / "shard-9.tar", "new-", 6)
    dl = loader(ds, 2, multiprocessing_context=multiprocessing.get_context("spawn"))
    orders = [keys_of(collect(dl)) for _ in range(2)]
    for order in orders:
        assert_exactly_once(order, expected)
    assert orders[0] != orders[1]
    assert ds.epoch == 2
    for epoch, order in enumerate(orders):
        assert order == epoch_order([str(p) for p in shards], 2, epoch, shuffle_buffer=5)


def test_a_pickled_dataset_keeps_its_shards_when_the_directory_changes(tmp_path):
    for shard in range(3):
        write_shard(tmp_path / f"shard-{shard}.tar", f"s{shard}-", 5)
    ds = shardstream.StreamingDataset(str(tmp_path), seed=SEED)
    pickled = pickle.dumps(ds)
    write_shard(tmp_path / "shard-3.tar", "new-", 5)
    clone = pickle.loads(pickled)
    assert clone.shards == ds.shards and len(clone.shard_list) == 3
    assert keys_of(collect(clone)) == keys_of(collect(ds))


def test_a_pickled_dataset_keeps_its_manifest_index(uneven_dataset):
    ds = shardstream.StreamingDataset(uneven_dataset.spec, seed=SEED, world_size=2, rank=1)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.manifest_path == ds.manifest_path is not None
    assert clone.shard_list.sample_counts == ds.shard_list.sample_counts
    assert len(clone) == len(ds)
    # Same shards and sample spans: a state of one resumes the other exactly.
    iterator = iter(ds)
    for _ in range(5):
        next(iterator)
    state = ds.state_dict()
    rest = keys_of(iterator)
    clone.load_state_dict(state)
    assert keys_of(collect(clone)) == rest


def test_a_pickled_parquet_dataset_keeps_its_row_groups(tmp_path):
    for part in range(2):
        ids = list(range(part * 100, part * 100 + 30))
        table = pa.table({"id": ids, "name": [f"row {i}" for i in ids]})
        pq.write_table(table, tmp_path / f"part-{part}.parquet", row_group_size=7)
    ds = shardstream.StreamingDataset(str(tmp_path), seed=SEED, shuffle_buffer=0)
    pickled = pickle.dumps(ds)
    pq.write_table(pa.table({"id": [999], "name": ["new"]}), tmp_path / "part-2.parquet")
    clone = pickle.loads(pickled)
    assert clone.shards == ds.shards and clone.shard_list.kinds == ["parquet"] * 10
    got = collect(clone)
    assert got == collect(ds)
    assert sorted(row["id"] for row in got) == list(range(30)) + list(range(100, 130))


def test_a_damaged_pickled_shard_list_is_refused():
    options = _core.Options()
    with pytest.raises(DatasetSpecError, match="its pickled shard list is not an encoded"):
        _core._rebuild_shard_list(["x.tar"], options, None, False, b"junk")
    with pytest.raises(DatasetSpecError, match="a count of 1 with 0 bytes left"):
        _core._rebuild_shard_list(["x.tar"], options, None, False, b"SSL4\x00\x01")


# --------------------------------------------------------------------------
# An iterator used in a forked child
# --------------------------------------------------------------------------


def test_an_iterator_started_in_the_parent_raises_in_a_forked_child(dataset):
    ds = shardstream.StreamingDataset(dataset.spec, seed=SEED)
    iterator = iter(ds)
    next(iterator)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what next() does, then leave at once
        try:
            os.close(read)
            try:
                next(iterator)
                message = "no error"
            except BaseException as error:
                message = f"{type(error).__name__}: {error}"
            os.write(write, message.encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 30)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        message = os.read(read, 4096).decode() if ready else "the child hung"
    finally:
        os.close(read)
        deadline = time.monotonic() + 10
        while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert message == (
        f"StreamProcessError: this stream was started in process {os.getpid()}; "
        "create a new iterator in this process"
    )
    assert issubclass(StreamProcessError, shardstream.ShardStreamError)
    # The parent's iterator goes on.
    assert len(keys_of(iterator)) == len(dataset.keys) - 1


# --------------------------------------------------------------------------
# Samples pickled in a DataLoader worker
# --------------------------------------------------------------------------


def pickle_in_worker(samples):
    """A DataLoader collate function (it runs in the worker): how each
    sample's long field pickles there."""
    out = []
    for sample in samples:
        value = sample["bin"]
        plain = pickle.dumps(value)
        out.append(
            {
                "key": sample["__key__"],
                "type": type(value).__name__,
                "length": len(value),
                "plain": len(plain),
                "round_trip": pickle.loads(plain) == value,
                "forking": len(bytes(ForkingPickler.dumps(value))),
            }
        )
    return out


def test_a_sample_pickled_in_a_worker_holds_its_bytes(tmp_path):
    members = []
    for i in range(4):
        members.append((f"k{i}.bin", bytes([i]) * 50_000))
        members.append((f"k{i}.txt", b"x"))
    path = write_tar(tmp_path / "shard.tar", members)
    ds = shardstream.StreamingDataset(str(path), shuffle_buffer=0)
    dl = DataLoader(ds, batch_size=2, num_workers=1, collate_fn=pickle_in_worker, timeout=120)
    rows = [row for batch in collect(dl) for row in batch]
    assert len(rows) == 4
    for row in rows:
        assert row["type"] == "LocalBytes" and row["length"] == 50_000
        assert row["plain"] >= 50_000 and row["round_trip"], row
        # multiprocessing's pickler (the DataLoader's hand-off) still
        # writes the place in the shard.
        assert row["forking"] < 1000, row

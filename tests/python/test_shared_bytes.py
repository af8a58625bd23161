"""Long members of S3 and compressed shards cross from DataLoader workers to
the main process through shared-memory segments, arrive as plain ``bytes``
equal to the pipe's, and leave nothing in /dev/shm: after the epoch, after
the loader is dropped mid-epoch, and after a worker is killed."""

from __future__ import annotations

import copy
import functools
import gc
import gzip
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import zstandard
from _shardtest import assert_exactly_once, collect, loader, read_tar_samples, write_tar
from s3_server import S3Server
from s3_server import s3_config as config
from torchdata.stateful_dataloader import StatefulDataLoader

import shardstream
from shardstream import shared_bytes

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

SHM_BUCKET = "shared"
# Members below and above the 16 KiB that are handed out by reference, one
# longer than a 4 MiB segment.
SIZES = [100, 20_000, 70_000, 300_000, 5_000, 150_000]
BIG = 5 << 20


def ours() -> list[str]:
    """Segments in /dev/shm named after this process."""
    return sorted(p.name for p in shared_bytes.SHM_DIR.glob(f"{shared_bytes.main_prefix()}*"))


def wait_until_released(limit: float = 10.0) -> None:
    """Waits (boundedly) for this process to hold and name no segment."""
    deadline = time.monotonic() + limit
    while (ours() or shared_bytes._OPEN) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ours() == [], "segments left in /dev/shm"
    assert shared_bytes._OPEN == {}, "segments left open"


def counting_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts ``shared_bytes.read_shared`` calls in this (the main) process."""
    calls: list[int] = []
    original = shared_bytes.read_shared

    @functools.wraps(original)
    def read_shared(path: str, use: int, offset: int, length: int, raise_: bool) -> bytes:
        # Named after this process, the one the worker hands its batches to.
        assert os.path.basename(path).startswith(shared_bytes.main_prefix()), path
        calls.append(length)
        return original(path, use, offset, length, raise_)

    monkeypatch.setattr(shared_bytes, "read_shared", read_shared)
    return calls


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """4 tar shards of 6 samples (one member of 5 MiB), with gzip and zstd
    copies, and their samples read with ``tarfile``."""
    root = tmp_path_factory.mktemp("shared")
    rng = random.Random(7)
    plain = []
    for shard in range(4):
        members = []
        for i, size in enumerate(SIZES):
            key = f"s{shard}/{i:03d}"
            size = BIG if (shard, i) == (1, 2) else size
            members.append((f"{key}.bin", rng.randbytes(size)))
            members.append((f"{key}.txt", key.encode()))
        plain.append(write_tar(root / f"shard-{shard}.tar", members))
    gz, zst = [], []
    for path in plain:
        data = path.read_bytes()
        gz.append(root / f"{path.stem}.tar.gz")
        gz[-1].write_bytes(gzip.compress(data, mtime=0))
        zst.append(root / f"{path.stem}.tar.zst")
        zst[-1].write_bytes(zstandard.ZstdCompressor(level=1).compress(data))
    expected = {s.key: s.fields for p in plain for s in read_tar_samples(p)}
    return {"plain": plain, "gz": gz, "zst": zst, "expected": expected}


@pytest.fixture(scope="module")
def s3_shards(s3: S3Server, shards: dict[str, Any]) -> str:
    """The plain shards under ``s3://shared/``."""
    client = s3.client()
    client.create_bucket(Bucket=SHM_BUCKET)
    for path in shards["plain"]:
        client.upload_file(str(path), SHM_BUCKET, path.name)
    return f"s3://{SHM_BUCKET}/"


def open_dataset(kind: str, shards: dict[str, Any], s3: S3Server, s3_url: str, **options: Any):
    if kind == "s3":
        return shardstream.StreamingDataset(s3_url, s3=config(s3), **options)
    return shardstream.StreamingDataset([str(p) for p in shards[kind]], manifest=False, **options)


def assert_samples(samples: list[dict[str, Any]], expected: dict[str, dict[str, bytes]]) -> None:
    assert_exactly_once([s["__key__"] for s in samples], expected)
    for sample in samples:
        fields = expected[sample["__key__"]]
        for name in ("bin", "txt"):
            assert type(sample[name]) is bytes, (sample["__key__"], type(sample[name]))
            assert sample[name] == fields[name], (sample["__key__"], name)


@pytest.mark.usefixtures("s3_credentials")
@pytest.mark.parametrize(
    ("kind", "context"),
    [("s3", "fork"), ("gz", "fork"), ("zst", "fork"), ("s3", "spawn"), ("gz", "forkserver")],
)
def test_long_members_cross_through_shared_memory_and_equal_the_pipe(
    kind: str,
    context: str,
    shards: dict[str, Any],
    s3: S3Server,
    s3_shards: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = counting_reads(monkeypatch)
    ds = open_dataset(kind, shards, s3, s3_shards, shuffle_buffer=5)
    through_shm = collect(loader(ds, 2, multiprocessing_context=context))
    assert_samples(through_shm, shards["expected"])
    long = [len(f["bin"]) for f in shards["expected"].values() if len(f["bin"]) >= 16 << 10]
    assert sorted(calls) == sorted(long)
    wait_until_released()
    # The same epoch through the pipe: every byte equal, in the same order.
    calls.clear()
    piped = open_dataset(
        kind, shards, s3, s3_shards, shuffle_buffer=5, worker_shared_memory_bytes=0
    )
    through_pipe = collect(loader(piped, 2))
    assert calls == []
    assert through_pipe == through_shm


def test_samples_kept_after_the_epoch_still_read_right(shards: dict[str, Any]) -> None:
    ds = open_dataset("zst", shards, None, "")  # type: ignore[arg-type]
    iterator = iter(loader(ds, 2, prefetch_factor=4))
    kept = list(iterator)
    del iterator
    gc.collect()
    wait_until_released()
    assert_samples(kept, shards["expected"])
    assert pickle.loads(pickle.dumps(kept)) == kept


def test_dropping_the_loader_mid_epoch_leaves_nothing(shards: dict[str, Any]) -> None:
    # 256 KiB segments (a quarter of the bound): each worker's 300 kB member
    # gets a one-off segment within the samples it pickles ahead.
    ds = open_dataset("gz", shards, None, "", shuffle_buffer=0, worker_shared_memory_bytes=1 << 20)  # type: ignore[arg-type]
    dl = loader(ds, 2, prefetch_factor=4)
    iterator = iter(dl)
    first = [next(iterator) for _ in range(3)]
    # The workers run ahead: wait for segments the main process has not
    # opened yet, so that dropping the loader has some to remove.
    deadline = time.monotonic() + 10
    while not ours() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ours(), "no segment in flight to test with"
    del iterator, dl
    gc.collect()
    wait_until_released()
    assert all(s["bin"] == shards["expected"][s["__key__"]]["bin"] for s in first)


def test_a_killed_worker_leaves_nothing_once_the_loader_is_gone(shards: dict[str, Any]) -> None:
    # Small segments, as above: the worker has named ones still unopened.
    ds = open_dataset("gz", shards, None, "", shuffle_buffer=0, worker_shared_memory_bytes=1 << 20)  # type: ignore[arg-type]
    dl = loader(ds, 2, prefetch_factor=4, timeout=0)
    iterator = iter(dl)
    # The main process removes a gone worker's segments while it holds
    # segments of workers (its check runs then; one that never mapped any
    # removes them at its exit): read until it holds some.
    # The batches read are kept, so that the segments they hold stay open.
    held = []
    deadline = time.monotonic() + 30
    while not shared_bytes._OPEN and time.monotonic() < deadline:
        held.append(next(iterator))
    assert shared_bytes._OPEN, "no batch came through shared memory"
    # The victim is a worker with a named segment the main process has not
    # opened. Which worker has one depends on timing: the main process
    # opens a batch's segments when it takes the batch from the queue,
    # which it may do before the batch's turn, so both workers may have
    # all of theirs opened and wait for work; reading on gives them some.
    pids = [w.pid for w in iterator._workers]
    named = [pid for pid in pids if any(f"-{pid}-" in n for n in ours())]
    deadline = time.monotonic() + 30
    while not named and time.monotonic() < deadline:
        held.append(next(iterator))
        time.sleep(0.05)
        named = [pid for pid in pids if any(f"-{pid}-" in n for n in ours())]
    assert named, "no segment of a worker to test with"
    victim = named[0]
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="DataLoader worker"):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            next(iterator)
            time.sleep(0.01)
    del iterator, dl, held
    gc.collect()
    wait_until_released()


def test_exact_resume_through_shared_memory(shards: dict[str, Any]) -> None:
    paths = [str(p) for p in shards["gz"]]

    def make() -> StatefulDataLoader:
        ds = shardstream.StreamingDataset(paths, manifest=False, seed=3, shuffle_buffer=5)
        ds.set_epoch(1)
        return StatefulDataLoader(ds, batch_size=3, num_workers=2, collate_fn=batch_of, timeout=120)

    full = collect(make())
    assert_exactly_once([k for batch in full for k, _ in batch], shards["expected"])
    k = len(full) // 2
    first = make()
    iterator = iter(first)
    prefix = [next(iterator) for _ in range(k)]
    state = json.loads(json.dumps(first.state_dict()))
    del iterator, first
    assert prefix == full[:k]
    resumed = make()
    resumed.load_state_dict(state)
    assert prefix + collect(resumed) == full
    for batch in full:
        for key, data in batch:
            assert type(data) is bytes and data == shards["expected"][key]["bin"]
    wait_until_released()


def batch_of(samples: list[dict[str, Any]]) -> list[tuple[str, bytes]]:
    """Keys and ``bin`` members of a batch (``bin`` as the worker hands it)."""
    return [(s["__key__"], s["bin"]) for s in samples]


def test_shared_memory_per_worker_is_bounded(shards: dict[str, Any]) -> None:
    """With a 1 MiB bound and a consumer that lags, each worker has at most
    1 MiB of segments named at any time; what does not fit goes through the
    pipe, and every byte arrives."""
    bound = 1 << 20
    ds = open_dataset("zst", shards, None, "", worker_shared_memory_bytes=bound)  # type: ignore[arg-type]
    seen = False
    samples = []
    for sample in loader(ds, 2, prefetch_factor=8):
        samples.append(sample)
        time.sleep(0.01)
        by_worker: dict[str, int] = {}
        for path in shared_bytes.SHM_DIR.glob(f"{shared_bytes.main_prefix()}*"):
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                continue
            worker = path.name.split("-")[3]
            by_worker[worker] = by_worker.get(worker, 0) + size
        seen = seen or bool(by_worker)
        assert all(total <= bound for total in by_worker.values()), by_worker
    assert_samples(samples, shards["expected"])
    assert seen, "no segment was ever named"
    wait_until_released()


def writer_in_this_process(monkeypatch: pytest.MonkeyPatch, limit: int) -> Callable[[bytes], Any]:
    """This process's writer, fresh, with ``limit``: pickles a ``SharedBytes``
    with ``ForkingPickler`` and gives what it pickled as."""
    monkeypatch.setattr(shared_bytes, "_WRITER", None)
    shared_bytes.configure(limit)

    def reduce(data: bytes) -> Any:
        return shared_bytes._reduce_shared(shared_bytes.SharedBytes(data))

    return reduce


def test_a_worker_writes_no_more_than_its_bound_then_uses_the_pipe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reduce = writer_in_this_process(monkeypatch, 8 << 20)
    data = random.Random(1).randbytes(512 << 10)
    places = [reduce(data) for _ in range(12)]
    assert all(function is shared_bytes.read_shared for function, _ in places)
    # Four 2 MiB segments (a quarter of the bound each) of three members,
    # none read yet: the bound is reached, the next member goes through the
    # pipe.
    paths = [args[0] for _, args in places]
    assert len(set(paths)) == 4
    assert sum(os.stat(p).st_size for p in set(paths)) == 8 << 20
    function, args = reduce(data)
    assert function is bytes and args == (data,)
    # The main process reading into the second segment marks the first one
    # done: the worker writes into it again.
    for _, place in places[:4]:
        assert shared_bytes.read_shared(*place) == data
    assert not os.path.exists(paths[0]) and not os.path.exists(paths[3])
    function, args = reduce(data)
    assert function is shared_bytes.read_shared and args[0] == paths[0]
    # Read in the order they were written, every member is intact.
    for _, place in [*places[4:], (function, args)]:
        assert shared_bytes.read_shared(*place) == data
    # Out of order is refused (only the DataLoader's queue carries them).
    with pytest.raises(shardstream.ShardReadError, match="read after"):
        shared_bytes.read_shared(*places[4][1])
    shared_bytes.release_all()
    shared_bytes._remove_paths(shared_bytes._writer().segments)
    assert not any(os.path.exists(p) for p in paths)


def test_shared_bytes_pickle_plainly_and_load_as_plain_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    writer_in_this_process(monkeypatch, 64 << 20)
    data = random.Random(2).randbytes(100_000)
    value = shared_bytes.SharedBytes(data)
    assert value == data and isinstance(value, bytes)
    for plain in (pickle.loads(pickle.dumps(value)), copy.copy(value), copy.deepcopy(value)):
        assert type(plain) in (bytes, shared_bytes.SharedBytes) and plain == data
    assert type(pickle.loads(pickle.dumps(value))) is bytes
    loaded = pickle.loads(ForkingPickler.dumps(value))
    assert type(loaded) is bytes and loaded == data
    shared_bytes.release_all()
    shared_bytes._remove_paths(shared_bytes._writer().segments)


def test_a_segment_gone_before_it_is_read_raises_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    reduce = writer_in_this_process(monkeypatch, 64 << 20)
    _, (path, use, offset, length, _) = reduce(b"x" * 20_000)
    os.unlink(path)
    with pytest.raises(shardstream.ShardReadError, match="shared-memory segment"):
        shared_bytes.read_shared(path, use, offset, length)


def test_segments_of_gone_main_processes_are_swept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A main process killed before it could remove its segments leaves them
    to the next process that reads one; those of a running main are kept."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)
    leftover = shared_bytes.SHM_DIR / f"{shared_bytes.main_prefix(gone.pid)}1-ab-0"
    running = shared_bytes.SHM_DIR / f"{shared_bytes.main_prefix(os.getppid())}1-ab-0"
    for path in (leftover, running):
        path.write_bytes(b"x")
    try:
        monkeypatch.setattr(shared_bytes, "_SWEPT", False)
        shared_bytes._sweep_gone_mains()
        assert not leftover.exists()
        assert running.exists()
    finally:
        for path in (leftover, running):
            path.unlink(missing_ok=True)

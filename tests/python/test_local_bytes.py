"""Long members of local shards cross from DataLoader workers to the main
process as references to their file, and arrive as plain ``bytes``."""

from __future__ import annotations

import copy
import functools
import importlib
import io
import multiprocessing
import os
import pickle
import random
import subprocess
import sys
import tarfile
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
from _shardtest import assert_exactly_once, keys_of, loader, read_tar_samples, write_tar

import shardstream
from shardstream import local_bytes

# The shortest member handed out by reference (and shared from the mapping).
REFERENCE_MIN = 16 << 10
# Members below, at and above it; two shards of 6 samples stay within one
# 1 MiB chunk each, so every long member is shared from the mapping.
SIZES = [100, REFERENCE_MIN - 1, REFERENCE_MIN, 70_000, 150_000, 5_000]


def write_shards(root: Path) -> list[Path]:
    rng = random.Random(3)
    paths = []
    for shard in range(2):
        members = []
        for i, size in enumerate(SIZES):
            key = f"s{shard}/{i:03d}"
            members.append((f"{key}.bin", rng.randbytes(size)))
            members.append((f"{key}.txt", key.encode()))
        paths.append(write_tar(root / f"shard-{shard}.tar", members))
    return paths


def counting_read_local(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """Counts the calls of ``local_bytes.read_local`` in this process (the
    DataLoader's main process, where batches are unpickled); returns the
    length read and whether malloc thresholds were to be raised, per call."""
    calls: list[tuple[int, bool]] = []
    original = local_bytes.read_local

    @functools.wraps(original)
    def read_local(
        path: str, offset: int, length: int, identity: tuple[int, ...], raise_thresholds: bool
    ) -> bytes:
        calls.append((length, raise_thresholds))
        return original(path, offset, length, identity, raise_thresholds)

    monkeypatch.setattr(local_bytes, "read_local", read_local)
    return calls


@pytest.mark.parametrize("by_reference", [True, False])
def test_long_members_cross_by_reference_and_arrive_as_plain_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, by_reference: bool
) -> None:
    paths = write_shards(tmp_path)
    expected = {s.key: s for p in paths for s in read_tar_samples(p)}
    calls = counting_read_local(monkeypatch)
    dataset = shardstream.StreamingDataset(
        [str(p) for p in paths], shuffle_buffer=4, local_bytes_by_reference=by_reference
    )
    samples = list(loader(dataset, 2))
    assert_exactly_once(keys_of(samples), expected)
    for sample in samples:
        want = expected[sample["__key__"]]
        assert type(sample["bin"]) is bytes and type(sample["txt"]) is bytes
        assert sample["bin"] == want.fields["bin"], sample["__key__"]
        assert sample["txt"] == want.fields["txt"]
    lengths = [len(s.fields["bin"]) for s in expected.values()]
    long = [n for n in lengths if n >= REFERENCE_MIN]
    assert len(long) == 6
    assert sorted(calls) == ([(n, True) for n in sorted(long)] if by_reference else [])


def test_references_carry_the_choice_not_to_raise_malloc_thresholds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = write_shards(tmp_path)
    calls = counting_read_local(monkeypatch)
    dataset = shardstream.StreamingDataset(
        [str(p) for p in paths], shuffle_buffer=4, raise_malloc_thresholds=False
    )
    assert len(list(loader(dataset, 2))) == 2 * len(SIZES)
    assert len(calls) == 6 and not any(raise_thresholds for _, raise_thresholds in calls)


@pytest.mark.parametrize("raise_thresholds", [True, False])
def test_each_worker_raises_malloc_thresholds_when_it_starts_streaming(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raise_thresholds: bool
) -> None:
    paths = write_shards(tmp_path)
    context = multiprocessing.get_context("fork")
    raised_in = context.Array("i", 8)
    calls = context.Value("i", 0)

    def record() -> bool:
        # Forked workers inherit this patch; each writes its process id.
        with calls.get_lock():
            raised_in[calls.value] = os.getpid()
            calls.value += 1
        return True

    monkeypatch.setattr(shardstream.dataset, "raise_malloc_thresholds", record)
    dataset = shardstream.StreamingDataset(
        [str(p) for p in paths], raise_malloc_thresholds=raise_thresholds
    )
    samples = list(loader(dataset, 2, multiprocessing_context=context))
    assert len(samples) == 2 * len(SIZES)
    pids = set(raised_in[: calls.value])
    if raise_thresholds:
        assert calls.value == 2 and os.getpid() not in pids and len(pids) == 2
    else:
        assert calls.value == 0


@pytest.mark.parametrize("raise_thresholds", [True, False])
def test_the_main_process_raises_malloc_thresholds_when_it_iterates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raise_thresholds: bool
) -> None:
    """With ``num_workers=0`` the main process makes each sample's
    ``bytes``: its iteration of a dataset or a ``Mix`` raises the
    thresholds, unless the option is off; making one does not."""
    paths = write_shards(tmp_path)
    calls: list[int] = []

    def record() -> bool:
        calls.append(os.getpid())
        return True

    for module in ("shardstream.dataset", "shardstream.mix"):
        monkeypatch.setattr(importlib.import_module(module), "raise_malloc_thresholds", record)
    spec = [str(p) for p in paths]
    dataset = shardstream.StreamingDataset(spec, raise_malloc_thresholds=raise_thresholds)
    mix = shardstream.Mix(
        [shardstream.StreamingDataset(spec, raise_malloc_thresholds=raise_thresholds)]
    )
    assert calls == []
    assert len(list(loader(dataset, 0))) == 2 * len(SIZES)
    assert len(list(loader(mix, 0))) == 2 * len(SIZES)
    assert calls == ([os.getpid()] * 2 if raise_thresholds else [])


# Frees a batch of 32 fresh 80 KB bytes objects, 20 times, and prints the
# minor page faults of the last 19 rounds: the heap the first round grew is
# either kept for the next round or given back to the kernel and faulted in
# again, 20 pages per object.
HEAP_REUSE = """
import resource, sys
from shardstream import _core
if sys.argv[1] == "raised":
    assert _core.raise_malloc_thresholds()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for round in range(20):
    if round == 1:
        start = faults()
    batch = [bytes([round]) * 80_000 for _ in range(32)]
    del batch
print(faults() - start)
"""


def test_raised_malloc_thresholds_keep_a_freed_batch_for_the_next() -> None:
    def faults(mode: str) -> int:
        run = subprocess.run(
            [sys.executable, "-c", HEAP_REUSE, mode],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return int(run.stdout)

    # 19 rounds of 32 objects of 20 pages: about 12,000 faults if each round
    # takes fresh pages.
    default, raised = faults("default"), faults("raised")
    assert default > 5_000, default
    assert raised < 500, raised


def test_without_workers_values_are_plain_bytes(tmp_path: Path) -> None:
    paths = write_shards(tmp_path)
    samples = list(loader(shardstream.StreamingDataset([str(p) for p in paths]), 0))
    assert len(samples) == 2 * len(SIZES)
    assert all(type(s["bin"]) is bytes for s in samples)


def identity(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def by_reference(value: bytes) -> bytes:
    """``value`` as the DataLoader's worker result queue pickles it."""
    return bytes(ForkingPickler.dumps(value))


def test_local_bytes_cross_processes_as_their_place_and_load_as_bytes(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    content = random.Random(5).randbytes(100_000)
    path.write_bytes(content)
    value = local_bytes.LocalBytes(content[1000:51_000], str(path), 1000, *identity(path))
    assert isinstance(value, bytes) and value == content[1000:51_000]
    pickled = by_reference(value)
    assert len(pickled) < 1000, "the bytes themselves are not in the pickle"
    loaded = pickle.loads(pickled)
    assert type(loaded) is bytes and loaded == content[1000:51_000]


def test_local_bytes_pickle_plainly_as_their_bytes(tmp_path: Path) -> None:
    """Plain pickle (a cache, a queue to another host) holds the data: it
    loads the same after the shard is gone."""
    path = tmp_path / "shard.tar"
    content = random.Random(6).randbytes(60_000)
    path.write_bytes(content)
    value = local_bytes.LocalBytes(content[:50_000], str(path), 0, *identity(path))
    pickled = pickle.dumps(value)
    assert len(pickled) >= 50_000
    path.unlink()
    for loaded in (pickle.loads(pickled), copy.deepcopy(value), copy.copy(value)):
        assert type(loaded) is bytes and loaded == content[:50_000]


def test_a_replaced_shard_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    path.write_bytes(b"a" * 50_000)
    pickled = by_reference(local_bytes.LocalBytes(b"a" * 20_000, str(path), 0, *identity(path)))
    replacement = tmp_path / "new.tar"
    replacement.write_bytes(b"b" * 60_000)
    os.replace(replacement, path)
    with pytest.raises(shardstream.ObjectChangedError, match=r"shard\.tar: the shard changed"):
        pickle.loads(pickled)


def test_a_missing_or_short_shard_is_an_error_naming_shard_and_offset(tmp_path: Path) -> None:
    path = tmp_path / "short.tar"
    path.write_bytes(b"c" * 30_000)
    beyond = local_bytes.LocalBytes(b"c" * 20_000, str(path), 20_000, *identity(path))
    at_end = r"short\.tar: read failed at byte offset 30000"
    with pytest.raises(shardstream.ShardReadError, match=at_end):
        pickle.loads(by_reference(beyond))
    gone = tmp_path / "gone.tar"
    gone.write_bytes(b"d" * 30_000)
    pickled = by_reference(local_bytes.LocalBytes(b"d" * 20_000, str(gone), 0, *identity(gone)))
    gone.unlink()
    with pytest.raises(shardstream.ShardNotFoundError, match=r"gone\.tar"):
        pickle.loads(pickled)


def test_relative_shard_paths_are_found_from_another_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = write_shards(tmp_path / "data")
    expected = {s.key: s for p in paths for s in read_tar_samples(p)}
    monkeypatch.chdir(tmp_path)
    relative = [str(p.relative_to(tmp_path)) for p in paths]
    batches = iter(loader(shardstream.StreamingDataset(relative, shuffle_buffer=4), 2))
    samples = [next(batches)]
    # The workers keep their working directory; the main process moves away
    # before it unpickles the rest.
    monkeypatch.chdir("/")
    samples.extend(batches)
    assert_exactly_once(keys_of(samples), expected)
    for sample in samples:
        assert sample["bin"] == expected[sample["__key__"]].fields["bin"], sample["__key__"]


def test_a_shard_cut_short_under_a_worker_is_a_read_error_not_a_dead_worker(
    tmp_path: Path,
) -> None:
    # 1 MB members of a 72 MB shard, mapped, parsed and queued in the worker
    # well ahead of the main process, which cuts the shard to 16 MiB. The
    # bytes go through the pipe, so only the worker reads the shard.
    size, count = 1_000_000, 72
    path = tmp_path / "big.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for index in range(count):
            info = tarfile.TarInfo(f"s{index:04d}.bin")
            info.size = size
            tar.addfile(info, io.BytesIO(bytes([index % 251 + 1]) * size))
    dataset = shardstream.StreamingDataset(
        str(path), shuffle_buffer=0, local_bytes_by_reference=False
    )
    intact, altered = 0, 0
    with pytest.raises(shardstream.ShardReadError, match=r"big\.tar: read failed at byte offset"):
        for sample in loader(dataset, 1):
            index = int(sample["__key__"][1:])
            if sample["bin"] == bytes([index % 251 + 1]) * size:
                intact += 1
            else:
                altered += 1
            if intact + altered == 3:
                os.truncate(path, 16 << 20)
    assert altered == 0, "a sample held bytes that were not in the file"
    assert 3 <= intact < count

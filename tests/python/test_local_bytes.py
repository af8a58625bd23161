"""Long members of local shards cross from DataLoader workers to the main
process as references to their file, and arrive as plain ``bytes``."""

from __future__ import annotations

import functools
import os
import pickle
import random
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


def counting_read_local(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls of ``local_bytes.read_local`` in this process (the
    DataLoader's main process, where batches are unpickled); returns the
    lengths read."""
    calls: list[int] = []
    original = local_bytes.read_local

    @functools.wraps(original)
    def read_local(path: str, offset: int, length: int, identity: tuple[int, ...]) -> bytes:
        calls.append(length)
        return original(path, offset, length, identity)

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
    assert sorted(calls) == (sorted(long) if by_reference else [])


def test_without_workers_values_are_plain_bytes(tmp_path: Path) -> None:
    paths = write_shards(tmp_path)
    samples = list(loader(shardstream.StreamingDataset([str(p) for p in paths]), 0))
    assert len(samples) == 2 * len(SIZES)
    assert all(type(s["bin"]) is bytes for s in samples)


def identity(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def test_local_bytes_pickle_as_their_place_and_load_as_bytes(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    content = random.Random(5).randbytes(100_000)
    path.write_bytes(content)
    value = local_bytes.LocalBytes(content[1000:51_000], str(path), 1000, *identity(path))
    assert isinstance(value, bytes) and value == content[1000:51_000]
    pickled = pickle.dumps(value)
    assert len(pickled) < 1000, "the bytes themselves are not in the pickle"
    loaded = pickle.loads(pickled)
    assert type(loaded) is bytes and loaded == content[1000:51_000]


def test_a_replaced_shard_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    path.write_bytes(b"a" * 50_000)
    pickled = pickle.dumps(local_bytes.LocalBytes(b"a" * 20_000, str(path), 0, *identity(path)))
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
        pickle.loads(pickle.dumps(beyond))
    gone = tmp_path / "gone.tar"
    gone.write_bytes(b"d" * 30_000)
    pickled = pickle.dumps(local_bytes.LocalBytes(b"d" * 20_000, str(gone), 0, *identity(gone)))
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

"""A manifest is evidence, not truth: what it records of a shard (size, ETag,
modification time, each sample's byte span) is checked against the shard
before it is trusted, so that a shard changed since it was indexed is an
error naming it, never samples silently lost. And a local shard that cannot
be counted under ``on_error="warn"`` is skipped with a warning naming it,
never blamed on another. Real servers: tests/python/http_server.py and
moto's S3."""

from __future__ import annotations

import io
import json
import os
import tarfile
import warnings
from typing import Any

import pytest
from _shardtest import (
    collect,
    index_manifest,
    loader,
    shard_keys,
    shardstream_cli,
    uneven_members,
    write_tar,
    write_uneven_dataset,
)
from http_server import running_http_server
from s3_server import s3_config

import shardstream
from shardstream import (
    ManifestMismatchError,
    ShardFormatError,
    ShardReadError,
    ShardSkippedWarning,
    StreamingDataset,
)

pytestmark = pytest.mark.timeout(180)

COUNTS = (4, 8, 3, 6)


def keys(ds: StreamingDataset, num_workers: int = 0) -> list[str]:
    return [s["__key__"] for s in collect(loader(ds, num_workers))]


def test_a_remote_shard_named_outright_and_re_exported_is_refused_not_read_short(tmp_path):
    """HTTP shards named by a brace range get no size at resolution: the
    reads check each one against the size its manifest records."""
    data = tmp_path / "site" / "d"
    write_uneven_dataset(data, COUNTS)
    with running_http_server(tmp_path / "site") as http:
        spec = http.url(f"d/part-{{000000..{len(COUNTS) - 1:06d}}}.tar")
        index_manifest([spec], data / "manifest.json")
        # Re-exported with two more samples, the manifest left as it was.
        write_tar(data / "part-000001.tar", uneven_members(1, COUNTS[1] + 2))
        ds = StreamingDataset(spec, count_samples=True, shuffle_buffer=0)
        assert ds.manifest_path == http.url("d/manifest.json")
        shard = http.url("d/part-000001.tar")
        with pytest.raises(ShardReadError) as raised:
            keys(ds)
        message = str(raised.value)
        assert shard in message and "shardstream index" in message, message
        assert f"not the {ds.shard_list.sizes[1]} bytes" in message, message


def test_an_http_shard_cached_in_a_newer_version_than_its_manifest_is_refused(tmp_path):
    """The cache holds the version of an HTTP shard that a dataset without
    the manifest read; the manifest records the version before (same size,
    other bytes): a dataset with the manifest refuses it by its ETag, not
    serves the copy."""
    data = tmp_path / "site" / "d"
    info = write_uneven_dataset(data, COUNTS)
    with running_http_server(tmp_path / "site") as http:
        spec = http.url(f"d/part-{{000000..{len(COUNTS) - 1:06d}}}.tar")
        index_manifest([spec], data / "manifest.json")
        changed = bytearray(info.paths[2].read_bytes())
        changed[600] ^= 0xFF  # inside the first member's data: the same size
        info.paths[2].write_bytes(bytes(changed))
        cache = tmp_path / "cache"
        assert len(keys(StreamingDataset(spec, manifest=False, cache_dir=cache))) == sum(COUNTS)
        assert len(list(cache.glob("*.shard"))) == len(COUNTS)
        ds = StreamingDataset(spec, count_samples=True, shuffle_buffer=0, cache_dir=cache)
        assert ds.manifest_path == http.url("d/manifest.json")
        with pytest.raises(ShardReadError) as raised:
            keys(ds)
        message = str(raised.value)
        assert http.url(f"d/{info.paths[2].name}") in message and "ETag" in message, message


@pytest.mark.usefixtures("s3_credentials")
@pytest.mark.parametrize("cached", [False, True])
def test_an_s3_shard_named_outright_with_another_etag_is_refused(s3, tmp_path, cached):
    """Same size, other bytes: the ETag the manifest records tells, also
    when the cache holds a copy of the new version (read by a dataset
    without the manifest): that copy is not the version the manifest
    describes."""
    client = s3.client()
    client.create_bucket(Bucket="evidence")
    info = write_uneven_dataset(tmp_path / "local", COUNTS)
    for path in info.paths:
        client.upload_file(str(path), "evidence", f"e/{path.name}")
    spec = f"s3://evidence/e/part-{{000000..{len(COUNTS) - 1:06d}}}.tar"
    s3_flags = ["--s3-endpoint-url", s3.endpoint_url, "--s3-path-style", "--s3-region", "us-east-1"]
    proc = shardstream_cli("index", spec, "-o", "s3://evidence/e/manifest.json", *s3_flags)
    assert proc.returncode == 0, proc.stderr
    changed = bytearray(info.paths[2].read_bytes())
    changed[600] ^= 0xFF  # inside the first member's data: the same size
    client.put_object(Bucket="evidence", Key=f"e/{info.paths[2].name}", Body=bytes(changed))
    cache: dict[str, Any] = {}
    if cached:
        cache["cache_dir"] = tmp_path / "cache"
        unlisted = StreamingDataset(spec, s3=s3_config(s3), manifest=False, **cache)
        assert len(keys(unlisted)) == sum(COUNTS)
        assert len(list(cache["cache_dir"].glob("*.shard"))) == len(COUNTS)
    ds = StreamingDataset(spec, s3=s3_config(s3), count_samples=True, shuffle_buffer=0, **cache)
    assert ds.manifest_path == "s3://evidence/e/manifest.json"
    with pytest.raises(ShardReadError) as raised:
        keys(ds)
    message = str(raised.value)
    assert f"s3://evidence/e/{info.paths[2].name}" in message, message
    assert "ETag" in message and "shardstream index" in message, message


def test_a_local_tar_appended_to_within_its_padding_is_refused(tmp_path):
    """Appending a sample to a tar often keeps its size (records are padded
    to 10,240 bytes): the modification time the manifest records tells."""
    info = write_uneven_dataset(tmp_path / "d", COUNTS)
    index_manifest([info.spec], tmp_path / "d" / "manifest.json")
    recorded = json.loads((tmp_path / "d" / "manifest.json").read_text())["shards"][0]
    path = info.paths[0]
    with tarfile.open(path, "a") as tar:
        for name, data in uneven_members(9, 1):
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    stat = path.stat()
    assert stat.st_size == recorded["size"], "the append kept the size"
    os.utime(path, ns=(stat.st_atime_ns, recorded["mtime_ns"] + 1_000_000_000))
    with pytest.raises(ManifestMismatchError) as raised:
        StreamingDataset(info.spec)
    message = str(raised.value)
    assert str(path) in message and "modification time" in message, message
    assert str(recorded["mtime_ns"]) in message and "shardstream index" in message, message


def test_a_sample_length_the_manifest_records_short_is_refused(tmp_path):
    """The last sample of a shard recorded 1,024 bytes short (its last
    member left out): a read runs to the next sample (or the shard's end),
    and the sample's members must end where its length says."""
    info = write_uneven_dataset(tmp_path / "d", COUNTS)
    manifest_path = tmp_path / "d" / "manifest.json"
    manifest = index_manifest([info.spec], manifest_path)
    entry = manifest["shards"][1]
    last = entry["samples"] - 1
    entry["lengths"][last] -= 1024
    manifest_path.write_text(json.dumps(manifest))
    ds = StreamingDataset(info.spec, shuffle_buffer=0)
    assert ds.shard_list.manifest_path == str(manifest_path)
    with pytest.raises(ManifestMismatchError) as raised:
        keys(ds)
    message = str(raised.value)
    start = entry["offsets"][last]
    assert str(info.paths[1]) in message and f"sample {last}" in message, message
    assert f"bytes {start}..{start + entry['lengths'][last]}" in message, message


def four_samples(path, compress: bool):
    """A tar (gzip-compressed or not) of samples a, b, c, d, 1,024 bytes each."""
    members = []
    for key in "abcd":
        member = tarfile.TarInfo(f"{key}.txt")
        member.size = 1
        members.append((member, b"x"))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for member, data in members:
            tar.addfile(member, io.BytesIO(data))
    data = buffer.getvalue()
    if compress:
        import gzip

        data = gzip.compress(data, mtime=0)
    path.write_bytes(data)


@pytest.mark.parametrize("compress", [False, True], ids=["tar", "tar.gz"])
@pytest.mark.parametrize(
    ("left_out", "world_size"),
    [("a", 1), ("d", 1), ("a", 2), ("d", 2), ("c", 2)],
)
def test_a_sample_the_manifest_leaves_out_is_refused(tmp_path, compress, left_out, world_size):
    """A manifest whose spans leave out a sample of the shard (its size and
    modification time still the shard's): before the first recorded
    sample, after the last, or between two where the plan cuts the shard
    between ranks. Each read of a plain shard starts at the shard's first
    byte for its first sample and goes on to the next recorded sample (to
    the shard's end after its last), so the sample is found and its span
    is refused; before, it was left out silently."""
    path = tmp_path / ("s.tar.gz" if compress else "s.tar")
    four_samples(path, compress)
    manifest_path = tmp_path / "manifest.json"
    manifest = index_manifest([str(path)], manifest_path)
    entry = manifest["shards"][0]
    assert entry["offsets"] == [0, 1024, 2048, 3072]
    kept = [i for i, key in enumerate("abcd") if key != left_out]
    entry["samples"] = 3
    entry["offsets"] = [entry["offsets"][i] for i in kept]
    entry["lengths"] = [entry["lengths"][i] for i in kept]
    manifest_path.write_text(json.dumps(manifest))
    seen, errors = [], []
    for rank in range(world_size):
        ds = StreamingDataset(
            str(path),
            manifest=str(manifest_path),
            shuffle_buffer=0,
            shuffle_shards=False,
            remainder="pad",
            rank=rank,
            world_size=world_size,
        )
        try:
            seen += keys(ds)
        except ManifestMismatchError as error:
            errors.append(str(error))
    assert errors, f"{left_out} left out silently: the ranks read {seen}"
    assert all(str(path) in message for message in errors), errors
    assert any("spans bytes" in message for message in errors), errors
    # The manifest as indexed reads every sample.
    index_manifest([str(path)], manifest_path)
    ds = StreamingDataset(str(path), manifest=str(manifest_path), shuffle_buffer=0)
    assert sorted(keys(ds)) == list("abcd")


def test_the_damage_a_read_meets_past_its_last_sample_is_the_next_read_s(tmp_path):
    """A compressed shard cut between two ranks: rank 0's read goes on past
    its last sample to check the next one's span, and meets that sample's
    damage (a member named like a sample's own names). It is rank 1's to
    report, as before reads went on: rank 0 completes its shard."""
    import gzip

    def shard(third: str) -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for name in ("a.txt", "b.txt", third, "d.txt"):
                member = tarfile.TarInfo(name)
                member.size = 1
                tar.addfile(member, io.BytesIO(b"x"))
        # Stored blocks: the damaged shard has the indexed one's size.
        return gzip.compress(buffer.getvalue(), compresslevel=0, mtime=0)

    path = tmp_path / "s.tar.gz"
    path.write_bytes(shard("c.txt"))
    manifest_path = tmp_path / "manifest.json"
    recorded = index_manifest([str(path)], manifest_path)["shards"][0]
    damaged = shard("c.__url__")
    assert len(damaged) == recorded["size"]
    path.write_bytes(damaged)
    os.utime(path, ns=(recorded["mtime_ns"], recorded["mtime_ns"]))

    def rank(r: int, **options: Any) -> StreamingDataset:
        return StreamingDataset(
            str(path),
            manifest=str(manifest_path),
            shuffle_buffer=0,
            shuffle_shards=False,
            rank=r,
            world_size=2,
            **options,
        )

    first = rank(0)
    assert keys(first) == ["a", "b"]
    assert first.stats()["shards_completed"] == 1
    with pytest.raises(ShardFormatError, match=r"c\.__url__"):
        keys(rank(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warned = rank(0, on_error="warn")
        assert keys(warned) == ["a", "b"]
    assert warned.stats()["errors_skipped"] == 0, [str(w.message) for w in caught]


def test_a_damaged_local_shard_met_while_counting_under_warn_is_named_and_skipped(tmp_path):
    """Counted for equal ranks under ``on_error="warn"``: the damaged shard
    is skipped with a warning naming it and the offset, every rank plans
    the same epoch without it, and no later message blames another."""
    info = write_uneven_dataset(tmp_path / "d", COUNTS)
    damaged = info.paths[2]
    whole = damaged.read_bytes()
    damaged.write_bytes(whole[:1536])  # cut inside the first member's data
    healthy = [k for p in info.paths if p != damaged for k in shard_keys(info, p)]
    per_rank = []
    for rank in (0, 1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ds = StreamingDataset(
                info.spec, world_size=2, rank=rank, on_error="warn", shuffle_buffer=0
            )
        skipped = [w for w in caught if issubclass(w.category, ShardSkippedWarning)]
        assert len(skipped) == 1, [str(w.message) for w in caught]
        text = str(skipped[0].message)
        assert str(damaged) in text and "truncated" in text and "byte offset" in text, text
        assert ds.shard_list.sample_counts[2] == 0
        got = keys(ds, 2)
        assert len(got) == len(ds)
        per_rank.append(got)
    every = per_rank[0] + per_rank[1]
    assert len(set(every)) == len(every) and set(every) <= set(healthy)
    assert len(every) >= len(healthy) - 1
    # A mixture counts the stream the same way: no error blaming a shard.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardSkippedWarning)
        stream = StreamingDataset(info.spec, on_error="warn", shuffle_buffer=0)
        other = StreamingDataset(str(info.paths[0]), shuffle_buffer=0)
        shardstream.Mix([stream, other], policy="stop")
    assert stream.shard_list.sample_counts[2] == 0
    # Under "raise" the counting error itself is raised, naming the shard.
    with pytest.raises(ShardFormatError, match=str(damaged)):
        StreamingDataset(info.spec, world_size=2, rank=0)

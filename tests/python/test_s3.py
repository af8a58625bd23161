"""S3 shards against a real S3-compatible server (moto's, on loopback):
listing, brace ranges, exactly-once through DataLoader workers, parallel
ranged GETs, read amplification, and errors for missing objects."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import zstandard
from _shardtest import read_tar_samples, sample_digest, tar_bytes
from s3_server import BUCKET, free_port
from s3_server import s3_config as config

import shardstream
from shardstream import StreamingDataset

pytestmark = pytest.mark.usefixtures("s3_credentials")


def collect(ds: StreamingDataset, num_workers: int) -> list[dict]:
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers)
    return list(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_prefix_listing_streams_every_sample_once(s3, s3_dataset, num_workers):
    ds = StreamingDataset(f"s3://{BUCKET}/audio/", s3=config(s3), shuffle_buffer=8)
    assert [u for u, _ in ds.shards] == sorted(s3_dataset["urls"])
    assert [size for _, size in ds.shards] == [s3_dataset["sizes"][u] for u, _ in ds.shards]
    samples = collect(ds, num_workers)
    keys = [s["__key__"] for s in samples]
    assert Counter(keys) == Counter(list(s3_dataset["expected"]))
    for sample in samples:
        url, digest = s3_dataset["expected"][sample["__key__"]]
        assert sample["__url__"] == url
        assert sample_digest(sample) == digest
    stats = ds.stats()
    # Read amplification 1.00: every byte of every shard fetched exactly once.
    assert stats["bytes_read"] == sum(s3_dataset["sizes"].values())
    assert stats["requests"] >= len(s3_dataset["urls"])


def test_brace_range_on_s3_and_ranks_split(s3, s3_dataset):
    n = len(s3_dataset["urls"])
    spec = f"s3://{BUCKET}/audio/shard-{{000000..{n - 1:06d}}}.tar"
    seen: list[str] = []
    fetched = 0
    for worker in range(2):
        ds = StreamingDataset(spec, s3=config(s3), num_workers=2, worker_id=worker)
        seen += [s["__key__"] for s in collect(ds, 0)]
        fetched += ds.stats()["bytes_read"]
    assert Counter(seen) == Counter(list(s3_dataset["expected"]))
    assert fetched == sum(s3_dataset["sizes"].values())
    # Several ranks need sample counts, which remote shards only have from a
    # manifest: refused at construction, naming the command that writes one.
    with pytest.raises(shardstream.DatasetSpecError, match="shardstream index"):
        StreamingDataset(spec, s3=config(s3), rank=0, world_size=2)


def test_parallel_ranged_gets_reassemble_in_order(s3, s3_dataset, dataset):
    ds = StreamingDataset(
        s3_dataset["urls"][:2],
        s3=config(s3, part_size=16 << 10, max_concurrency=3),
        shuffle_buffer=0,
        shuffle_shards=False,
    )
    samples = list(ds)
    expected = [
        s
        for p, u in zip(dataset.paths[:2], s3_dataset["urls"][:2], strict=True)
        for s in read_tar_samples(p, u)
    ]
    assert [s["__key__"] for s in samples] == [e.key for e in expected]
    assert [sample_digest(s) for s in samples] == [e.digest() for e in expected]
    stats = ds.stats()
    parts = sum(-(-s3_dataset["sizes"][u] // (16 << 10)) for u in s3_dataset["urls"][:2])
    # Parts after the tar's end-of-archive blocks may be left unfetched.
    assert 2 < stats["requests"] <= parts
    assert stats["bytes_read"] <= sum(s3_dataset["sizes"][u] for u in s3_dataset["urls"][:2])


def test_parallel_ranged_gets_when_the_budget_holds_one_part(s3, s3_dataset):
    """Objects in flight share the read-ahead budget; here one object's share
    holds two 128 KiB parts: with two parts in flight the next part must
    wait for the first one's delivery, not deadlock."""
    client = s3.client()
    payloads = {}
    for shard in range(2):
        members = []
        for i in range(24):
            data = hashlib.sha256(f"{shard}/{i}".encode()).digest() * 1024
            payloads[f"s{shard}_{i:03d}"] = data
            members.append((f"s{shard}_{i:03d}.bin", data))
        client.put_object(Bucket=BUCKET, Key=f"big/shard-{shard}.tar", Body=tar_bytes(members))
    ds = StreamingDataset(
        f"s3://{BUCKET}/big/",
        s3=config(s3, part_size=128 << 10, max_concurrency=4),
        read_ahead_bytes=256 << 10,
        io_timeout=20.0,
        shuffle_buffer=0,
    )
    assert all(size > 4 * (128 << 10) for _, size in ds.shards)
    samples = {s["__key__"]: s["bin"] for s in ds}
    assert samples == payloads
    stats = ds.stats()
    assert stats["bytes_read"] == sum(size for _, size in ds.shards)
    assert stats["requests"] >= 2 * 5


def test_missing_object_and_bucket(s3, s3_dataset):
    missing = f"s3://{BUCKET}/audio/nope.tar"
    ds = StreamingDataset(missing, s3=config(s3))
    with pytest.raises(shardstream.ShardNotFoundError, match=r"nope\.tar"):
        next(iter(ds))
    with pytest.raises(shardstream.ShardNotFoundError, match="no-such-bucket"):
        StreamingDataset("s3://no-such-bucket/x/", s3=config(s3))


# Marks of a Rust Debug dump of an error struct, never in a message.
DEBUG_DUMP = ("{", "}", "DispatchFailure", "ConnectorError", "Error {", "Some(", "source:")


def raised_by(error: type[Exception], make) -> str:
    """The message of ``error`` raised by ``make()`` or by its first sample."""
    with pytest.raises(error) as info:
        next(iter(make()))
    message = str(info.value)
    for mark in DEBUG_DUMP:
        assert mark not in message, f"{mark!r} in {message!r}"
    return message


def test_error_messages_are_sentences_not_debug_dumps(s3, s3_dataset):
    """The store's error code and message, or what the connection did, in
    a sentence that names the URL: never the SDK's error structs."""
    missing_key = f"s3://{BUCKET}/audio/nope.tar"
    message = raised_by(
        shardstream.ShardNotFoundError, lambda: StreamingDataset(missing_key, s3=config(s3))
    )
    assert message.startswith(missing_key) and "HTTP 404 NoSuchKey" in message
    missing_bucket = "s3://no-such-bucket/x.tar"
    message = raised_by(
        shardstream.ShardNotFoundError, lambda: StreamingDataset(missing_bucket, s3=config(s3))
    )
    assert message.startswith(missing_bucket) and "NoSuchBucket" in message
    message = raised_by(
        shardstream.ShardNotFoundError,
        lambda: StreamingDataset("s3://no-such-bucket/x/", s3=config(s3)),
    )
    assert "NoSuchBucket" in message
    # Nobody listens: each attempt's connection is refused.
    nobody = config(f"http://127.0.0.1:{free_port()}", max_attempts=2)
    message = raised_by(
        shardstream.ShardReadError, lambda: StreamingDataset(missing_key, s3=nobody)
    )
    assert message.startswith(missing_key), message
    assert "gave up after 2 attempts: connection failed" in message, message


def test_warn_policy_skips_a_missing_object(s3, s3_dataset):
    urls = [*s3_dataset["urls"][:2], f"s3://{BUCKET}/audio/gone.tar"]
    ds = StreamingDataset(urls, s3=config(s3), on_error="warn")
    with pytest.warns(shardstream.ShardSkippedWarning, match=r"gone\.tar"):
        keys = [s["__key__"] for s in ds]
    expected = [k for k, (u, _) in s3_dataset["expected"].items() if u in urls]
    assert sorted(keys) == sorted(expected)
    assert ds.stats()["errors_skipped"] == 1


def test_no_secret_in_repr_or_errors(s3, monkeypatch):
    secret = "SECRET" + hashlib.sha256(b"x").hexdigest()[:12]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    cfg = config(s3)
    ds = StreamingDataset(f"s3://{BUCKET}/audio/nope.tar", s3=cfg)
    assert secret not in repr(cfg) and secret not in repr(ds)
    with pytest.raises(shardstream.ShardStreamError) as info:
        next(iter(ds))
    assert secret not in str(info.value)


def test_index_records_etags_and_a_replaced_object_mismatches(s3, s3_dataset, tmp_path):
    manifest = tmp_path / "manifest.json"
    cli = [
        "shardstream",
        "--s3-endpoint-url",
        s3.endpoint_url,
        "--s3-region",
        "us-east-1",
        "--s3-path-style",
    ]
    assert (
        shardstream._core.run_cli([*cli, "index", f"s3://{BUCKET}/audio/", "-o", str(manifest)])
        == 0
    )
    entries = json.loads(manifest.read_text())["shards"]
    assert [e["url"] for e in entries] == sorted(s3_dataset["urls"])
    client = s3.client()
    for entry in entries:
        head = client.head_object(Bucket=BUCKET, Key=entry["url"].split("/", 3)[3])
        assert entry["etag"] == head["ETag"]
        assert entry["size"] == head["ContentLength"]
    ds = StreamingDataset(f"s3://{BUCKET}/audio/", s3=config(s3), manifest=manifest, world_size=3)
    assert len(ds) == len(s3_dataset["expected"]) // 3
    for rank in range(3):
        part = StreamingDataset(
            f"s3://{BUCKET}/audio/", s3=config(s3), manifest=manifest, rank=rank, world_size=3
        )
        assert sum(1 for _ in part) == len(ds)
    # Same size, other content: the listing's ETag no longer matches.
    victim = entries[0]["url"].split("/", 3)[3]
    body = client.get_object(Bucket=BUCKET, Key=victim)["Body"].read()
    client.put_object(Bucket=BUCKET, Key=victim, Body=body[::-1])
    try:
        with pytest.raises(shardstream.ManifestMismatchError, match="ETag"):
            StreamingDataset(f"s3://{BUCKET}/audio/", s3=config(s3), manifest=manifest)
    finally:
        client.put_object(Bucket=BUCKET, Key=victim, Body=body)


def test_index_of_explicit_keys_asks_their_size_and_etag(s3, s3_dataset, tmp_path):
    manifest = tmp_path / "manifest.json"
    urls = s3_dataset["urls"][:3]
    cli = ["shardstream", "--s3-endpoint-url", s3.endpoint_url, "--s3-path-style"]
    assert shardstream._core.run_cli([*cli, "index", *urls, "-o", str(manifest)]) == 0
    entries = json.loads(manifest.read_text())["shards"]
    assert [e["url"] for e in entries] == urls
    assert [e["size"] for e in entries] == [s3_dataset["sizes"][u] for u in urls]
    assert all(e["etag"] for e in entries)
    ds = StreamingDataset(urls, s3=config(s3), manifest=manifest, remainder="pad", world_size=2)
    expected = sum(1 for _, (u, _) in s3_dataset["expected"].items() if u in urls)
    assert len(ds) == -(-expected // 2)


def test_listing_pages_past_1000_keys(s3):
    """ListObjectsV2 returns at most 1000 keys a page: a prefix of 1003
    shards (and a few other objects) needs every page, filtered and sorted."""
    client = s3.client()
    bucket = "many-shards"
    client.create_bucket(Bucket=bucket)
    count = 1003
    names = [f"part/s-{i:05d}.tar" for i in range(count)]

    def upload(i: int) -> None:
        body = tar_bytes([(f"k{i:05d}.txt", str(i).encode())])
        client.put_object(Bucket=bucket, Key=names[i], Body=body)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(upload, reversed(range(count))))
    for other in ("part/index.json", "part/zzz.txt", "part/s-00001.tar.bak"):
        client.put_object(Bucket=bucket, Key=other, Body=b"{}")
    ds = StreamingDataset(f"s3://{bucket}/part/", s3=config(s3), shuffle_buffer=64)
    assert [url for url, _ in ds.shards] == [f"s3://{bucket}/{name}" for name in names]
    samples = collect(ds, 2)
    assert Counter(s["__key__"] for s in samples) == Counter(f"k{i:05d}" for i in range(count))
    assert all(s["txt"] == str(int(s["__key__"][1:])).encode() for s in samples)
    assert ds.stats()["bytes_read"] == sum(size for _, size in ds.shards)


def test_compressed_shards_on_s3(s3, s3_dataset, dataset):
    """gzip and zstd shards listed under a prefix and read like plain ones."""
    client = s3.client()
    sources = {
        "compressed/a.tar.gz": dataset.paths[0],
        "compressed/b.tar.zst": dataset.paths[0],
        "compressed/c.tgz": dataset.paths[1],
    }
    zstd = zstandard.ZstdCompressor(write_checksum=True)
    bodies = {}
    for key, path in sources.items():
        plain = path.read_bytes()
        bodies[key] = zstd.compress(plain) if key.endswith(".zst") else gzip.compress(plain)
        client.put_object(Bucket=BUCKET, Key=key, Body=bodies[key])
    ds = StreamingDataset(f"s3://{BUCKET}/compressed/", s3=config(s3))
    assert [url for url, _ in ds.shards] == [f"s3://{BUCKET}/{k}" for k in sorted(sources)]
    samples = collect(ds, 2)
    expected = [
        (f"s3://{BUCKET}/{key}", s.key, s.digest())
        for key, path in sources.items()
        for s in read_tar_samples(path)
    ]
    got = [(s["__url__"], s["__key__"], sample_digest(s)) for s in samples]
    assert sorted(got, key=str) == sorted(expected, key=str)
    assert ds.stats()["bytes_read"] == sum(len(b) for b in bodies.values())


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("part_size", 8 << 30),
        ("part_size", 0),
        ("max_concurrency", 10**6),
        ("max_concurrency", -1),
        ("max_attempts", 2**40),
        ("max_attempts", 0),
        ("connect_timeout", 1e30),
        ("first_byte_timeout", 1e12),
        ("idle_timeout", 0.0),
        ("max_retry_time", float("nan")),
        ("max_retry_time", -1.0),
    ],
)
def test_s3_options_out_of_range_are_refused_at_construction(s3, option, value):
    """Values the code cannot use (a part past what the budget's permits
    count, a timeout past what instants hold) are a ValueError naming the
    option before any request, for named objects and for a listing alike."""
    for spec in (f"s3://{BUCKET}/audio/shard-000000.tar", f"s3://{BUCKET}/audio/"):
        with pytest.raises(ValueError, match=rf"^invalid option (s3\.)?{option}: ") as info:
            StreamingDataset(spec, s3=config(s3, **{option: value}))
        assert "{" not in str(info.value)

"""Manifests where the shards are: a ``manifest.json`` beside remote shards
(S3, HTTP(S) with a brace spec, GCS, the Hub) is found and used as a local
one is, ``manifest=`` takes any supported URL, and ``shardstream index -o``
writes to S3. Real servers: moto's S3, tests/python/http_server.py, the GCS
JSON API server of tests/python/gcs_server.py and the fake Hub."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _shardtest import (
    assert_exactly_once,
    collect,
    index_manifest,
    loader,
    shardstream_cli,
    write_uneven_dataset,
)
from fake_hub import running_fake_hub
from gcs_server import running_gcs_api
from http_server import running_http_server
from s3_server import s3_config

import shardstream
from shardstream import ShardWriter, StreamingDataset

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("s3_credentials")]

COUNTS = (5, 9, 2, 8)


def both_ranks(spec: str, **options) -> list[str]:
    """Every key the two ranks of a job read (2 DataLoader workers each)."""
    keys: list[str] = []
    for rank in (0, 1):
        ds = StreamingDataset(spec, world_size=2, rank=rank, shuffle_buffer=0, **options)
        got = [s["__key__"] for s in collect(loader(ds, 2))]
        assert len(got) == len(ds)
        keys += got
    return keys


def test_a_writers_s3_manifest_is_found_beside_its_shards(s3):
    client = s3.client()
    client.create_bucket(Bucket="written-beside")
    keys = [f"k{i:03d}" for i in range(40)]
    with ShardWriter("s3://written-beside/p/shard-%06d.tar", max_count=7, s3=s3_config(s3)) as w:
        for key in keys:
            w.write({"__key__": key, "txt": key * 3})
    spec = "s3://written-beside/p/"
    assert_exactly_once(both_ranks(spec, s3=s3_config(s3)), keys)
    # Looked for when counts are needed: several ranks, or count_samples=True.
    ds = StreamingDataset(spec, s3=s3_config(s3), count_samples=True)
    assert ds.manifest_path == "s3://written-beside/p/manifest.json"
    assert len(ds) == 40
    # On one rank otherwise, no request is made for it.
    assert StreamingDataset(spec, s3=s3_config(s3)).manifest_path is None
    # Named explicitly, by its URL.
    named = StreamingDataset(
        "s3://written-beside/p/shard-{000000..000005}.tar",
        manifest="s3://written-beside/p/manifest.json",
        s3=s3_config(s3),
        world_size=2,
        rank=1,
    )
    assert named.manifest_path == "s3://written-beside/p/manifest.json"
    assert len(named) == 20
    with pytest.raises(shardstream.ManifestError, match=r"s3://written-beside/p/absent\.json"):
        StreamingDataset(spec, manifest="s3://written-beside/p/absent.json", s3=s3_config(s3))


def test_index_writes_to_s3_and_the_message_without_a_manifest_offers_it(s3, tmp_path):
    client = s3.client()
    client.create_bucket(Bucket="indexed-beside")
    info = write_uneven_dataset(tmp_path / "local", COUNTS)
    for path in info.paths:
        client.upload_file(str(path), "indexed-beside", f"q/{path.name}")
    spec = "s3://indexed-beside/q/"
    with pytest.raises(shardstream.DatasetSpecError) as refused:
        StreamingDataset(spec, s3=s3_config(s3), world_size=2, rank=0)
    command = f"shardstream index {spec} -o {spec}manifest.json"
    assert command in str(refused.value)
    s3_flags = ["--s3-endpoint-url", s3.endpoint_url, "--s3-path-style", "--s3-region", "us-east-1"]
    proc = shardstream_cli("index", spec, "-o", f"{spec}manifest.json", *s3_flags)
    assert proc.returncode == 0, proc.stderr
    stored = json.loads(
        client.get_object(Bucket="indexed-beside", Key="q/manifest.json")["Body"].read()
    )
    assert stored["format"] == "shardstream.manifest"
    assert sum(e["samples"] for e in stored["shards"]) == sum(COUNTS)
    assert_exactly_once(both_ranks(spec, s3=s3_config(s3)), info.keys)


def test_a_foreign_manifest_json_beside_remote_shards_is_passed_over(s3, tmp_path):
    client = s3.client()
    client.create_bucket(Bucket="foreign-beside")
    info = write_uneven_dataset(tmp_path / "local", COUNTS)
    for path in info.paths:
        client.upload_file(str(path), "foreign-beside", f"r/{path.name}")
    client.put_object(Bucket="foreign-beside", Key="r/manifest.json", Body=b'{"files": []}')
    with (
        pytest.warns(shardstream.ManifestIgnoredWarning, match="not a shardstream manifest"),
        pytest.raises(shardstream.DatasetSpecError, match="shardstream index"),
    ):
        StreamingDataset("s3://foreign-beside/r/", s3=s3_config(s3), world_size=2, rank=0)
    ds = StreamingDataset("s3://foreign-beside/r/", s3=s3_config(s3))
    assert sorted(s["__key__"] for s in ds) == sorted(info.keys)


def test_a_manifest_of_other_shards_beside_remote_parquet_files_is_not_theirs(s3, tmp_path):
    """Beside Parquet files on S3, a shardstream manifest that does not
    describe them (of tar shards once in that folder) is passed over, as
    beside local ones: the footers give the rows, both ranks read them
    all once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    client = s3.client()
    client.create_bucket(Bucket="parquet-beside")
    info = write_uneven_dataset(tmp_path / "local", COUNTS)
    urls = [f"s3://parquet-beside/p/{path.name}" for path in info.paths]
    for path in info.paths:
        client.upload_file(str(path), "parquet-beside", f"p/{path.name}")
    manifest = shardstream_cli(
        "--s3-endpoint-url", s3.endpoint_url, "--s3-path-style", "--s3-region", "us-east-1",
        "index", *urls, "-o", "s3://parquet-beside/p/manifest.json",
    )  # fmt: skip
    assert manifest.returncode == 0, manifest.stderr
    for path in info.paths:
        client.delete_object(Bucket="parquet-beside", Key=f"p/{path.name}")
    rows = [f"r{i:02d}" for i in range(12)]
    for f in range(2):
        pq.write_table(pa.table({"name": rows[f::2]}), tmp_path / f"{f}.parquet")
        client.upload_file(str(tmp_path / f"{f}.parquet"), "parquet-beside", f"p/{f}.parquet")
    spec, names = "s3://parquet-beside/p/{0..1}.parquet", []
    for rank in (0, 1):
        ds = StreamingDataset(spec, s3=s3_config(s3), world_size=2, rank=rank, shuffle_buffer=0)
        assert ds.manifest_path is None
        names += [row["name"] for row in ds]
    assert sorted(names) == rows


def remote_manifest(urls: list[str], tmp_path: Path) -> bytes:
    """``shardstream index`` of ``urls``, as bytes to put beside them."""
    out = tmp_path / "indexed.json"
    index_manifest(urls, out)
    return out.read_bytes()


def test_a_manifest_beside_http_shards_is_found(tmp_path):
    info = write_uneven_dataset(tmp_path / "site" / "data", COUNTS)
    with running_http_server(tmp_path / "site") as http:
        spec = http.url(f"data/part-{{000000..{len(COUNTS) - 1:06d}}}.tar")
        (tmp_path / "site" / "data" / "manifest.json").write_bytes(
            remote_manifest([spec], tmp_path)
        )
        assert_exactly_once(both_ranks(spec), info.keys)
        found = StreamingDataset(spec, count_samples=True)
        assert found.manifest_path == http.url("data/manifest.json")


def test_a_manifest_beside_gcs_shards_is_found(tmp_path, monkeypatch):
    info = write_uneven_dataset(tmp_path / "local", COUNTS)
    objects = {f"g/{p.name}": (p.read_bytes(), 100 + i) for i, p in enumerate(info.paths)}
    with running_gcs_api({"beside": objects}) as api:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", api.endpoint)
        monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
        monkeypatch.delenv("GCE_METADATA_HOST", raising=False)
        spec = "gs://beside/g/"
        objects["g/manifest.json"] = (remote_manifest([spec], tmp_path), 7)
        assert_exactly_once(both_ranks(spec), info.keys)
        found = StreamingDataset(spec, count_samples=True)
        assert found.manifest_path == "gs://beside/g/manifest.json"


def test_a_manifest_beside_hub_shards_is_found(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    info = write_uneven_dataset(root / "org" / "beside" / "train", COUNTS)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with running_http_server(root) as cdn, running_fake_hub(root, cdn.base_url) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.base_url)
        spec = "hf://datasets/org/beside/train/"
        (root / "org" / "beside" / "train" / "manifest.json").write_bytes(
            remote_manifest([spec], tmp_path)
        )
        assert_exactly_once(both_ranks(spec), info.keys)
        named = StreamingDataset(spec, manifest="hf://datasets/org/beside/train/manifest.json")
        assert len(named) == sum(COUNTS)


def test_a_manifest_beside_that_the_store_denies_is_passed_over(s3, tmp_path):
    """S3 answers 403 for a key it does not hold when the reader may not
    list the bucket: the manifest nobody asked for is passed over with a
    warning (the job then needs counts), never a StorageAuthError."""
    from fault_proxy import Faults, running_fault_proxy

    client = s3.client()
    client.create_bucket(Bucket="denied-beside")
    info = write_uneven_dataset(tmp_path / "local", COUNTS)
    for path in info.paths:
        client.upload_file(str(path), "denied-beside", f"d/{path.name}")
    spec = f"s3://denied-beside/d/part-{{000000..{len(COUNTS) - 1:06d}}}.tar"
    with running_fault_proxy(s3.endpoint_url, Faults(status_first=1, status=403)) as proxy:
        with (
            pytest.warns(shardstream.ManifestIgnoredWarning, match="access denied"),
            pytest.raises(shardstream.DatasetSpecError, match="shardstream index"),
        ):
            StreamingDataset(spec, s3=s3_config(proxy.endpoint_url), world_size=2, rank=0)
        assert proxy.injected.statuses == 1
        assert "/d/manifest.json" in proxy.injected.reads[0][1]

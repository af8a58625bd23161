"""``gs://`` specs against Google Cloud Storage on 127.0.0.1, pointed at with
``STORAGE_EMULATOR_HOST``: gcp-storage-emulator (started by the fixture) for
exactly-once reads through ranks and DataLoader workers, byte-identical to
the local read, ``shardstream index`` and missing objects and buckets; the
JSON API subset of gcs_server.py for listings in pages and a service
account's key exchanged for a token at a local token endpoint (the bearer
seen by the server, never in an error)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _shardtest import (
    DatasetInfo,
    assert_exactly_once,
    collect,
    loader,
    sample_digest,
    shardstream_cli,
)
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from gcs_server import GcsApi, running_gcs_api, running_gcs_emulator, upload

import shardstream
from shardstream import StreamingDataset

pytestmark = pytest.mark.timeout(120)

BUCKET = "shards"
FAST = {"max_attempts": 2, "max_retry_time": 5.0, "first_byte_timeout": 2.0, "idle_timeout": 2.0}


@pytest.fixture(scope="module")
def emulator(dataset: DatasetInfo) -> Iterator[str]:
    """The emulator holding the dataset's shards under ``train/`` (and a
    file that is not a shard)."""
    with running_gcs_emulator(BUCKET) as endpoint:
        for path in dataset.paths:
            upload(endpoint, BUCKET, f"train/{path.name}", path.read_bytes())
        upload(endpoint, BUCKET, "train/notes.txt", b"not a shard")
        yield endpoint


@pytest.fixture
def gcs(emulator: str, monkeypatch) -> str:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.delenv("GCE_METADATA_HOST", raising=False)
    return emulator


def assert_identical_to_local(samples: list[dict[str, Any]], dataset: DatasetInfo) -> None:
    assert_exactly_once([s["__key__"] for s in samples], dataset.keys)
    local = {s["__key__"]: sample_digest(s) for s in collect(StreamingDataset(dataset.spec))}
    for sample in samples:
        assert sample_digest(sample) == local[sample["__key__"]], sample["__key__"]


def test_index_over_gcs_gives_two_ranks_of_two_workers_every_sample_once(gcs, dataset, tmp_path):
    manifest = tmp_path / "manifest.json"
    spec = f"gs://{BUCKET}/train/"
    proc = shardstream_cli("index", spec, "-o", manifest)
    assert proc.returncode == 0, proc.stderr
    entries = json.loads(manifest.read_text())["shards"]
    assert len(entries) == len(dataset.paths)
    assert [e["size"] for e in entries] == [p.stat().st_size for p in dataset.paths]
    for entry, path in zip(entries, dataset.paths, strict=True):
        assert f"/b/{BUCKET}/o/train%2F{path.name}?alt=media&generation=" in entry["url"]
    total = len(dataset.keys)
    samples = []
    for rank in range(2):
        ds = StreamingDataset(spec, manifest=str(manifest), rank=rank, world_size=2, seed=3)
        assert len(ds) == total // 2
        got = collect(loader(ds, 2))
        assert len(got) == total // 2
        samples += got
    assert_identical_to_local(samples, dataset)


def test_brace_specs_of_keys_read_byte_identical(gcs, dataset):
    last = len(dataset.paths) - 1
    spec = f"gs://{BUCKET}/train/shard-{{000000..{last:06d}}}.tar"
    samples = collect(StreamingDataset(spec, shuffle_buffer=0))
    assert_identical_to_local(samples, dataset)
    assert samples[0]["__url__"].startswith(f"{gcs}/download/storage/v1/b/{BUCKET}/o/")


@pytest.mark.parametrize(
    ("url", "words"),
    [
        (f"gs://{BUCKET}/train/missing.tar", "missing.tar"),
        ("gs://no-such-bucket/train/a.tar", 'the bucket "no-such-bucket" does not exist'),
        ("gs://no-such-bucket/train/", 'the bucket "no-such-bucket" does not exist'),
    ],
)
def test_a_missing_object_or_bucket_is_an_error_naming_the_url(gcs, url, words):
    with pytest.raises(shardstream.ShardNotFoundError) as raised:
        StreamingDataset(url, s3=FAST)
    message = str(raised.value)
    assert url in message and words in message, message


def test_an_empty_prefix_and_a_bad_bucket_name_are_spec_errors(gcs):
    with pytest.raises(shardstream.DatasetSpecError, match="no shard under the prefix"):
        StreamingDataset(f"gs://{BUCKET}/nothing-here/")
    with pytest.raises(shardstream.DatasetSpecError, match="not a bucket name"):
        StreamingDataset("gs://Bad_Bucket/x.tar")


@pytest.fixture
def api(dataset: DatasetInfo, monkeypatch) -> Iterator[GcsApi]:
    """The JSON API subset with the dataset under ``train/`` (pages of 3)."""
    objects = {p.name: (p.read_bytes(), 1000 + i) for i, p in enumerate(dataset.paths)}
    with running_gcs_api({BUCKET: {f"train/{k}": v for k, v in objects.items()}}) as api:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", api.endpoint)
        monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
        monkeypatch.delenv("GCE_METADATA_HOST", raising=False)
        yield api


def test_a_prefix_is_listed_page_by_page_and_pinned_to_generations(api, dataset):
    ds = StreamingDataset(f"gs://{BUCKET}/train/")
    pages = (len(dataset.paths) + api.page_size - 1) // api.page_size
    assert api.page_tokens == [None] + [str(api.page_size * i) for i in range(1, pages)]
    samples = collect(loader(ds, 2))
    assert_identical_to_local(samples, dataset)
    urls = sorted({s["__url__"] for s in samples})
    assert [u.rsplit("generation=", 1)[1] for u in urls] == [
        str(1000 + i) for i in range(len(dataset.paths))
    ]
    # Anonymous: no Authorization header was sent.
    assert set(api.authorizations) == {None}


def service_account_key(path: Path, token_uri: str) -> rsa.RSAPrivateKey:
    """A throwaway service account's JSON key file at ``path``."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    info = {
        "type": "service_account",
        "project_id": "test",
        "private_key_id": "k1",
        "private_key": pem,
        "client_email": "reader@test.iam.gserviceaccount.com",
        "token_uri": token_uri,
    }
    path.write_text(json.dumps(info))
    return key


def test_a_service_account_key_is_exchanged_and_its_bearer_sent(
    api, dataset, tmp_path, monkeypatch
):
    key_file = tmp_path / "key.json"
    api.public_key = service_account_key(key_file, f"{api.endpoint}/token").public_key()
    api.required = True
    # Without credentials: refused, the error names the URL and what to do.
    url = f"gs://{BUCKET}/train/"
    with pytest.raises(shardstream.StorageAuthError) as raised:
        StreamingDataset(url, s3=FAST)
    assert url in str(raised.value) and "GOOGLE_APPLICATION_CREDENTIALS" in str(raised.value)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key_file))
    api.reset()
    ds = StreamingDataset(url, seed=1)
    assert_identical_to_local(collect(loader(ds, 2)), dataset)
    assert api.authorizations and set(api.authorizations) == {f"Bearer {api.token}"}
    # One token per process (the main one, and each of 2 workers), not per request.
    assert 1 <= api.token_requests <= 3
    assert api.media_gets >= len(dataset.paths)
    # A key the token endpoint does not accept: an error that names neither
    # the key nor a token.
    service_account_key(key_file, f"{api.endpoint}/token")
    with pytest.raises(shardstream.StorageAuthError) as raised:
        StreamingDataset(url, s3=FAST)
    message = str(raised.value)
    assert "invalid_grant" in message and url in message, message
    for secret in (api.token, "PRIVATE KEY", "assertion"):
        assert secret not in message and secret not in repr(raised.value), message


def test_the_bearer_never_appears_in_a_read_error(api, dataset, tmp_path, monkeypatch):
    key_file = tmp_path / "key.json"
    api.public_key = service_account_key(key_file, f"{api.endpoint}/token").public_key()
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key_file))
    ds = StreamingDataset(f"gs://{BUCKET}/train/", s3=FAST)
    # Objects replaced after the resolution: their pinned generation is gone.
    for key, (data, generation) in list(api.objects[BUCKET].items()):
        api.objects[BUCKET][key] = (data, generation + 1)
    with pytest.raises(shardstream.ShardNotFoundError) as raised:
        collect(ds)
    message = str(raised.value)
    assert "generation=" in message, message
    assert api.token not in message and api.token not in repr(raised.value)
    assert f"Bearer {api.token}" in api.authorizations


def test_the_metadata_servers_token_is_sent(api, dataset, monkeypatch):
    api.required = True
    monkeypatch.setenv("GCE_METADATA_HOST", api.endpoint.removeprefix("http://"))
    samples = collect(StreamingDataset(f"gs://{BUCKET}/train/shard-000000.tar", shuffle_buffer=0))
    local = collect(StreamingDataset(str(dataset.paths[0]), shuffle_buffer=0))
    assert [sample_digest(s) for s in samples] == [sample_digest(s) for s in local]
    assert local
    assert 1 <= api.token_requests <= 2
    assert set(api.authorizations) == {f"Bearer {api.token}"}

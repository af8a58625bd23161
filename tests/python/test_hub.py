"""``hf://datasets/...`` specs against a fake Hub on 127.0.0.1 (fake_hub.py,
pointed at with ``HF_ENDPOINT``): the revision resolved to its commit, the
tree listed page by page, shards read from the ``resolve`` endpoint through
its redirect to a second server serving ranges, exactly once through ranks
and workers, byte-identical, and the token sent to the Hub only."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from _shardtest import (
    DatasetInfo,
    assert_exactly_once,
    collect,
    key_batch,
    loader,
    sample_digest,
    shardstream_cli,
)
from fake_hub import COMMIT, FakeHub, running_fake_hub
from http_server import HttpServer, running_http_server
from torchdata.stateful_dataloader import StatefulDataLoader

import shardstream
from shardstream import StreamingDataset

pytestmark = pytest.mark.timeout(120)

REPO = "org/audio"
PRIVATE = "org/private"


@pytest.fixture(scope="module")
def hub_root(dataset: DatasetInfo, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two repositories holding the dataset's shards under ``train/``, with
    a README and a JSON file beside them."""
    root = tmp_path_factory.mktemp("hub")
    for repo in (REPO, PRIVATE):
        train = root / repo / "train"
        train.mkdir(parents=True)
        for path in dataset.paths:
            shutil.copy(path, train / path.name)
        (root / repo / "README.md").write_text("# audio\n")
        (train / "stats.json").write_text("{}")
    return root


@pytest.fixture(scope="module")
def cdn(hub_root: Path) -> Iterator[HttpServer]:
    with running_http_server(hub_root) as server:
        yield server


@pytest.fixture
def hub(hub_root: Path, cdn: HttpServer, monkeypatch, tmp_path) -> Iterator[FakeHub]:
    cdn.reset()
    with running_fake_hub(hub_root, cdn.base_url) as fake:
        fake.private.add(PRIVATE)
        monkeypatch.setenv("HF_ENDPOINT", fake.base_url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        for name in ("HF_TOKEN", "HF_TOKEN_PATH"):
            monkeypatch.delenv(name, raising=False)
        yield fake


def resolved(hub: FakeHub, repo: str, name: str) -> str:
    return f"{hub.base_url}/datasets/{repo}/resolve/{COMMIT}/train/{name}"


def assert_identical_to_local(samples: list[dict[str, Any]], dataset: DatasetInfo) -> None:
    assert_exactly_once([s["__key__"] for s in samples], dataset.keys)
    local = {s["__key__"]: sample_digest(s) for s in collect(StreamingDataset(dataset.spec))}
    for sample in samples:
        assert sample_digest(sample) == local[sample["__key__"]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_glob_is_resolved_pinned_to_the_commit_and_read_once(hub, cdn, dataset, num_workers):
    ds = StreamingDataset(f"hf://datasets/{REPO}/train/*.tar", shuffle_buffer=8)
    assert ds.shards == [(resolved(hub, REPO, p.name), p.stat().st_size) for p in dataset.paths]
    assert hub.requests["tree"] > 1  # every page of the listing
    samples = collect(loader(ds, num_workers))
    assert_identical_to_local(samples, dataset)
    assert all(s["__url__"].startswith(f"{hub.base_url}/datasets/{REPO}/") for s in samples)
    # Read through the redirect, from the second server, each byte once.
    assert cdn.served.body_bytes == sum(p.stat().st_size for p in dataset.paths)


def test_braces_folders_and_revisions(hub, dataset):
    names = [p.name for p in dataset.paths[:3]]
    braces = f"hf://datasets/{REPO}@v1/train/shard-{{000000..000002}}.tar"
    ds = StreamingDataset(braces)
    assert [u for u, _ in ds.shards] == [resolved(hub, REPO, n) for n in names]
    assert hub.requests["revision"] == 1  # one look-up for the three URLs
    folder = StreamingDataset(f"hf://datasets/{REPO}/train/")
    assert len(folder.shards) == len(dataset.paths)  # the .json file is not a shard
    pinned = StreamingDataset(f"hf://datasets/{REPO}@{COMMIT}/train/{names[0]}")
    assert [u for u, _ in pinned.shards] == [resolved(hub, REPO, names[0])]


@pytest.mark.parametrize(
    ("spec", "error", "words"),
    [
        ("hf://datasets/org/nothing/train/*.tar", shardstream.StorageAuthError, "HF_TOKEN"),
        (f"hf://datasets/{REPO}@v9/train/*.tar", shardstream.ShardNotFoundError, '"v9"'),
        (f"hf://datasets/{REPO}/train/absent.tar", shardstream.ShardNotFoundError, "absent.tar"),
        (f"hf://datasets/{REPO}/train/*.tar.zst", shardstream.DatasetSpecError, "no file"),
        (f"hf://datasets/{PRIVATE}/train/*.tar", shardstream.StorageAuthError, "HTTP 401"),
        ("hf://models/org/name/x.tar", shardstream.DatasetSpecError, "dataset repositories"),
    ],
)
def test_what_cannot_be_resolved_is_an_error_naming_the_url(hub, spec, error, words):
    with pytest.raises(error) as raised:
        StreamingDataset(spec, s3={"max_attempts": 2})
    message = str(raised.value)
    assert spec.split("*")[0].split("{")[0] in message and words in message, message


def test_a_private_repository_takes_the_token_which_goes_to_the_hub_only(
    hub, cdn, dataset, monkeypatch, tmp_path
):
    spec = f"hf://datasets/{PRIVATE}/train/*.tar"
    monkeypatch.setenv("HF_TOKEN", hub.token)
    ds = StreamingDataset(spec)
    assert_identical_to_local(collect(loader(ds, 2)), dataset)
    assert cdn.served.headers and all("authorization" not in h for h in cdn.served.headers)
    assert hub.token not in repr(ds)
    # The token file huggingface_hub writes, under HF_HOME.
    monkeypatch.delenv("HF_TOKEN")
    token_file = tmp_path / "hf-home" / "token"
    token_file.parent.mkdir(parents=True)
    token_file.write_text(hub.token + "\n")
    assert len(collect(StreamingDataset(f"hf://datasets/{PRIVATE}/train/{dataset.paths[0].name}")))
    # A wrong token is refused, and not shown.
    monkeypatch.setenv("HF_TOKEN", "hf_wrong_value")
    with pytest.raises(shardstream.StorageAuthError) as raised:
        StreamingDataset(spec)
    assert "hf_wrong_value" not in str(raised.value)


def test_a_listing_that_cannot_be_followed_to_its_end_is_an_error(hub):
    """Before, a next page already read ended the listing (its first pages
    only, the rest left out without a word), and a file listed without its
    size was a shard of 0 bytes."""
    spec = f"hf://datasets/{REPO}/train/*.tar"
    hub.next_cursor = 0
    with pytest.raises(shardstream.ShardReadError, match="was read already") as raised:
        StreamingDataset(spec)
    assert spec in str(raised.value)
    hub.next_cursor = None
    hub.no_size.add("train/shard-000001.tar")
    with pytest.raises(shardstream.ShardReadError, match=r'no size for "train/shard-000001\.tar"'):
        StreamingDataset(spec)


def test_a_double_star_takes_no_folder_too_and_a_files_own_name_is_that_file(
    hub, hub_root, dataset
):
    """``train/**/*.tar`` takes ``train/a.tar`` (fsspec's and git's globs
    do), and ``a[1].tar`` names that file, not ``a1.tar``. Before, the first
    left out the files directly in ``train/``, the second read another file."""
    repo = "org/globs"
    train = hub_root / repo / "train"
    (train / "sub").mkdir(parents=True, exist_ok=True)
    for path, name in zip(dataset.paths, ["a[1].tar", "a1.tar", "sub/b.tar"], strict=False):
        shutil.copy(path, train / name)

    def names(ds: StreamingDataset) -> list[str]:
        return [unquote(url.split(f"/{COMMIT}/", 1)[1]) for url, _ in ds.shards]

    every = StreamingDataset(f"hf://datasets/{repo}/train/**/*.tar")
    assert names(every) == ["train/a1.tar", "train/a[1].tar", "train/sub/b.tar"]
    literal = StreamingDataset(f"hf://datasets/{repo}/train/a[1].tar", shuffle_buffer=0)
    assert names(literal) == ["train/a[1].tar"]
    assert sorted(s["__key__"] for s in literal) == sorted(dataset.keys_of(dataset.urls[:1]))
    # Where no file has the name, it is a glob, as before.
    assert names(StreamingDataset(f"hf://datasets/{repo}/train/a[0-9].tar")) == ["train/a1.tar"]


def test_a_next_page_on_another_origin_is_refused_and_gets_no_headers(hub, hub_root, monkeypatch):
    # The user's headers and the token go to the Hub's endpoint (the
    # shards' origin) only: a listing linking its next page elsewhere is an
    # error, and nothing is sent there.
    monkeypatch.setenv("HF_TOKEN", hub.token)
    spec = f"hf://datasets/{REPO}/train/*.tar"
    with running_http_server(hub_root) as elsewhere:
        hub.next_origin = elsewhere.base_url
        with pytest.raises(shardstream.ShardReadError) as raised:
            StreamingDataset(spec, http_headers={"X-Secret": "s3cr3t"}, s3={"max_attempts": 2})
        assert elsewhere.served.headers == []
    message = str(raised.value)
    assert spec in message and "another origin" in message and elsewhere.base_url in message
    assert "s3cr3t" not in message and hub.token not in message


def test_index_then_ranks_get_equal_lengths_exactly_once(hub, cdn, dataset, tmp_path):
    spec = f"hf://datasets/{REPO}/train/*.tar"
    manifest = tmp_path / "manifest.json"
    proc = shardstream_cli("index", spec, "-o", manifest)
    assert proc.returncode == 0, proc.stderr
    entries = json.loads(manifest.read_text())["shards"]
    assert [e["url"] for e in entries] == [resolved(hub, REPO, p.name) for p in dataset.paths]
    total = len(dataset.keys)
    keys = []
    for rank in range(2):
        ds = StreamingDataset(spec, manifest=str(manifest), rank=rank, world_size=2)
        assert len(ds) == total // 2
        keys += [s["__key__"] for s in collect(loader(ds, 2))]
    assert_exactly_once(keys, dataset.keys)


def test_exact_resume_mid_epoch(hub, dataset):
    def resumable() -> StatefulDataLoader:
        ds = StreamingDataset(f"hf://datasets/{REPO}/train/*.tar", seed=5, shuffle_buffer=7)
        return StatefulDataLoader(
            ds, batch_size=4, num_workers=2, collate_fn=key_batch, timeout=120
        )

    full = collect(resumable())
    assert_exactly_once([k for batch in full for k in batch], dataset.keys)
    first = resumable()
    iterator = iter(first)
    prefix = [next(iterator) for _ in range(len(full) // 2)]
    state = json.loads(json.dumps(first.state_dict()))
    del iterator, first
    resumed = resumable()
    resumed.load_state_dict(state)
    assert prefix + collect(resumed) == full

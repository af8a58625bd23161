"""Fixtures: a small generated dataset, read independently with ``tarfile``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _shardtest import (
    DatasetInfo,
    brace_spec,
    describe,
    index_manifest,
    load_example,
    read_tar_samples,
    write_tar,
    write_uneven_dataset,
)
from http_server import HttpServer, running_http_server
from s3_server import BUCKET, TEST_KEY_ID, TEST_SECRET, S3Server, running_s3_server

SHARDS = 8
SAMPLES_PER_SHARD = 12
TASKS = Path("/proc/self/task")

# The modules whose tests launch jobs (torchrun, frameworks), build or install
# wheels, start store servers or benchmarks: marked `slow`, so that
# `make test-fast` leaves them out; `make test` runs every test.
SLOW_MODULES = {
    "test_accelerate",
    "test_cache",
    "test_dcp",
    "test_distributed",
    "test_fabric",
    "test_grain",
    "test_job_resolution",
    "test_lightning",
    "test_mix_torchrun",
    "test_ray",
    "test_recipes",
    "test_resume_matrix",
    "test_store_conformance",
    "test_torchrun",
    "test_train_bench",
    "test_train_lm",
    "test_wheel",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__ in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


def stream_threads() -> int:
    """Native threads of shardstream streams (pipeline and I/O) in this process."""
    count = 0
    for task in TASKS.iterdir() if TASKS.is_dir() else ():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:
            continue  # the thread ended while we looked
        count += name.startswith("shardstream")
    return count


@pytest.fixture(autouse=True)
def _stream_threads_wound_down():
    """A stream's threads finish shortly *after* its last sample; let them,
    so one test's winding-down threads never show up in the next test."""
    yield
    deadline = time.monotonic() + 3
    while stream_threads() and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture(scope="session")
def make_dataset():
    """The ``make_dataset`` function of ``examples/make_dataset.py``."""
    return load_example("make_dataset").make_dataset


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory, make_dataset) -> DatasetInfo:
    """8 shards x 12 samples of short clips (~75 KB per shard), with the
    expected samples read from the tars with ``tarfile``."""
    root = tmp_path_factory.mktemp("dataset")
    paths = make_dataset(
        root,
        shards=SHARDS,
        samples_per_shard=SAMPLES_PER_SHARD,
        seed=1234,
        min_seconds=0.05,
        max_seconds=0.2,
    )
    info = describe(paths, brace_spec(root, "shard", 0, len(paths) - 1))
    # Sanity of the fixture itself (computed from the tars, not assumed).
    assert len(info.samples) == len(set(info.keys)) > 0
    assert all(set(s.fields) == {"wav", "json"} for s in info.samples)
    return info


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory: pytest.TempPathFactory, make_dataset) -> DatasetInfo:
    """2 shards x 5 samples: fewer shards than most slot layouts."""
    root = tmp_path_factory.mktemp("small")
    paths = make_dataset(
        root, shards=2, samples_per_shard=5, seed=7, min_seconds=0.05, max_seconds=0.1
    )
    return describe(paths, brace_spec(root, "shard", 0, len(paths) - 1))


@pytest.fixture
def tar_factory(tmp_path: Path):
    """Writes a tar of ``[(name, bytes) | TarInfo, ...]`` under ``tmp_path``."""

    def make(name: str, members, **kwargs) -> Path:
        return write_tar(tmp_path / name, members, **kwargs)

    return make


@pytest.fixture(scope="session")
def uneven_dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetInfo:
    """Shards of 1, 40, 3, 17, 0 and 25 small samples (86 in all), indexed by
    ``shardstream index`` into the ``manifest.json`` beside them (so datasets
    over them find it; pass ``manifest=False`` to plan by bytes instead)."""
    root = tmp_path_factory.mktemp("uneven")
    info = write_uneven_dataset(root)
    index_manifest([root], root / "manifest.json")
    return info


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    """moto's S3 server, a subprocess on a free loopback port."""
    with running_s3_server() as server:
        yield server


@pytest.fixture(scope="session")
def s3_dataset(s3: S3Server, dataset: DatasetInfo) -> dict[str, Any]:
    """The ``dataset`` shards uploaded under ``s3://train/audio/``: their
    URLs, ``{key: (url, digest)}`` of every sample, and ``{url: size}``."""
    client = s3.client()
    client.create_bucket(Bucket=BUCKET)
    urls = []
    for path in dataset.paths:
        key = f"audio/{path.name}"
        client.upload_file(str(path), BUCKET, key)
        urls.append(f"s3://{BUCKET}/{key}")
    expected = {}
    for path, url in zip(dataset.paths, urls, strict=True):
        for sample in read_tar_samples(path, url):
            expected[sample.key] = (url, sample.digest())
    sizes = {url: path.stat().st_size for path, url in zip(dataset.paths, urls, strict=True)}
    return {"urls": urls, "expected": expected, "sizes": sizes}


@pytest.fixture
def s3_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test server's keys in the environment, and no profile."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", TEST_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def dataset_http_server(dataset: DatasetInfo) -> Iterator[HttpServer]:
    """A local HTTP server (tests/python/http_server.py) serving `dataset`'s shards."""
    with running_http_server(dataset.root) as running:
        yield running


@pytest.fixture
def http(dataset_http_server: HttpServer) -> HttpServer:
    """The dataset's HTTP server, its faults and counters reset."""
    dataset_http_server.reset()
    return dataset_http_server

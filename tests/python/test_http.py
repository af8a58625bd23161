"""HTTP(S) shards against a real HTTP server on 127.0.0.1 (http_server.py):
brace specs, exactly-once through ranks and DataLoader workers, output
byte-identical to the local read, read amplification 1.00, parallel ranged
GETs, retries, resumes pinned to the validator, a server that ignores Range,
an object replaced mid-read, a server that never answers, a short body,
redirects, headers (never shown), ``shardstream index`` and resume."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from _shardtest import (
    DatasetInfo,
    assert_exactly_once,
    collect,
    key_batch,
    loader,
    sample_digest,
    shardstream_cli,
    write_tar,
    write_uneven_dataset,
)
from fault_proxy import Faults as ProxyFaults
from fault_proxy import running_fault_proxy
from http_server import Faults, HttpServer, running_http_server
from torchdata.stateful_dataloader import StatefulDataLoader

import shardstream
from shardstream import StreamingDataset

pytestmark = pytest.mark.timeout(120)

# Quick retries, so that the error tests end within seconds.
FAST = {"max_attempts": 3, "max_retry_time": 10.0, "first_byte_timeout": 2.0, "idle_timeout": 2.0}


def http_spec(server: HttpServer, dataset: DatasetInfo) -> str:
    return server.shard_spec(len(dataset.paths))


def local_digests(dataset: DatasetInfo) -> dict[str, dict[str, str]]:
    """Every sample's digest as the local read of the same shards gives it."""
    return {s["__key__"]: sample_digest(s) for s in collect(StreamingDataset(dataset.spec))}


def assert_identical_to_local(samples: list[dict[str, Any]], dataset: DatasetInfo) -> None:
    assert_exactly_once([s["__key__"] for s in samples], dataset.keys)
    local = local_digests(dataset)
    for sample in samples:
        assert sample_digest(sample) == local[sample["__key__"]], sample["__key__"]
        assert sample["__url__"].startswith("http://127.0.0.1:")


def shard_bytes(dataset: DatasetInfo) -> int:
    return sum(p.stat().st_size for p in dataset.paths)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_sample_once_byte_identical_with_amplification_one(http, dataset, num_workers):
    ds = StreamingDataset(http_spec(http, dataset), shuffle_buffer=8)
    assert [u for u, _ in ds.shards] == [http.url(p.name) for p in dataset.paths]
    samples = collect(loader(ds, num_workers))
    assert_identical_to_local(samples, dataset)
    assert http.served.body_bytes == shard_bytes(dataset)  # read amplification 1.00


def test_parallel_ranged_gets_reassemble_in_order(http, dataset):
    ds = StreamingDataset(
        http_spec(http, dataset), s3={"part_size": 4096, "max_concurrency": 4}, shuffle_buffer=0
    )
    assert_identical_to_local(collect(ds), dataset)
    assert http.served.body_bytes == shard_bytes(dataset)
    ranged = [h for h in http.served.headers if "range" in h]
    assert len(ranged) > 2 * len(dataset.paths)
    # Every part after the first is pinned to the first answer's ETag.
    assert all("if-match" in h for h in ranged if not h["range"].startswith("bytes=0-"))


def test_503s_are_retried(http, dataset):
    http.reset(Faults(fail_first=4))
    ds = StreamingDataset(http_spec(http, dataset), s3={"max_attempts": 8})
    assert_identical_to_local(collect(ds), dataset)
    assert http.served.faults["fail"] == 4
    assert ds.stats()["retries"] >= 4


@pytest.mark.parametrize("wrong", ["shifted", "short"])
def test_resets_slowdowns_and_wrong_ranges_from_a_proxy_are_retried(http, dataset, wrong):
    """Behind the fault-injecting proxy: 503s, connections reset before an
    answer, and ranged answers from the wrong offset or too short; every
    sample still comes once, byte-identical."""
    faults = ProxyFaults(slowdown_every=4, reset_every=7, **{f"{wrong}_on_range": 2})
    with running_fault_proxy(http.base_url, faults) as proxy:
        spec = proxy.endpoint_url + "/" + http_spec(http, dataset).split("/", 3)[3]
        options = {"part_size": 32768, "max_attempts": 12}
        ds = StreamingDataset(spec, s3=options, shuffle_buffer=0)
        assert_identical_to_local(collect(loader(ds, 2)), dataset)
    injected = proxy.injected
    assert injected.slowdowns and injected.resets
    assert getattr(injected, f"{wrong}_answers") == 2


def test_a_cut_body_resumes_from_its_offset_pinned_to_the_etag(http, dataset):
    http.reset(Faults(cut_first=3, cut_after=5000))
    ds = StreamingDataset(http_spec(http, dataset), s3={"max_concurrency": 1})
    assert_identical_to_local(collect(ds), dataset)
    assert http.served.faults["cut"] == 3
    assert ds.stats()["resumed_bodies"] == 3
    assert http.served.body_bytes == shard_bytes(dataset)  # no byte fetched twice
    # The first body is cut three times: resumed from bytes 5000, 10000, 15000.
    resumes = [h["range"] for h in http.served.headers if "if-match" in h]
    last = dataset.paths[0].stat().st_size - 1
    assert resumes == [f"bytes={5000 * i}-{last}" for i in (1, 2, 3)]


def test_without_an_etag_a_resume_is_pinned_to_last_modified(http, dataset):
    http.reset(Faults(cut_first=1, no_etag=True))
    ds = StreamingDataset(http_spec(http, dataset), s3={"max_concurrency": 1})
    assert_identical_to_local(collect(ds), dataset)
    resume = [h for h in http.served.headers if h.get("range", "").startswith("bytes=1000-")]
    assert len(resume) == 1 and "if-unmodified-since" in resume[0]


def test_a_server_that_ignores_range_is_read_past_what_was_delivered(http, dataset):
    http.reset(Faults(cut_first=2, ignore_range=True))
    ds = StreamingDataset(http_spec(http, dataset), s3={"max_concurrency": 1})
    samples = collect(ds)
    assert_identical_to_local(samples, dataset)  # no byte twice, none lost
    assert ds.stats()["resumed_bodies"] == 2


def large_members(version: int = 0) -> dict[str, bytes]:
    """150 members of 40 KB; another `version` has other bytes, the same sizes."""
    return {
        f"{i:04d}.bin": bytes([(i + version) % 251]) * 40_000 + i.to_bytes(4, "big")
        for i in range(150)
    }


def write_large_shard(root: Path) -> dict[str, bytes]:
    """A 6 MB shard of 150 members (far larger than a first part, 256 KiB)."""
    root.mkdir()
    members = large_members()
    write_tar(root / "shard.tar", members.items())
    return {key.removesuffix(".bin"): value for key, value in members.items()}


def test_a_resource_without_validator_replaced_mid_read_is_one_version(tmp_path):
    # Neither ETag nor Last-Modified: nothing to pin parts to, so the shard
    # is one GET; replaced (same size) once that GET was answered, every
    # sample is of the first version.
    root = tmp_path / "unpinned"
    expected = write_large_shard(root)
    replacement = tmp_path / "v2.tar"
    write_tar(replacement, large_members(version=7).items())
    assert replacement.stat().st_size == (root / "shard.tar").stat().st_size
    with running_http_server(root) as server:
        faults = Faults(no_validator=True, replace_after=1, replacement=replacement.read_bytes())
        server.reset(faults)
        ds = StreamingDataset(server.url("shard.tar"), s3={"part_size": 65536})
        got = {s["__key__"]: s["bin"] for s in ds}
        gets = server.served.gets_by_path["/shard.tar"]
    assert got == expected
    assert gets == 1, gets


@pytest.mark.parametrize("max_concurrency", [1, 64])
def test_a_cut_body_without_validator_is_an_error_not_a_splice(tmp_path, max_concurrency):
    root = tmp_path / "unpinned"
    write_large_shard(root)
    with running_http_server(root) as server:
        server.reset(Faults(no_validator=True, cut_first=1, cut_after=1_000_000))
        url = server.url("shard.tar")
        ds = StreamingDataset(url, s3={**FAST, "max_concurrency": max_concurrency})
        with pytest.raises(shardstream.ShardReadError) as raised:
            collect(ds)
        gets = server.served.gets_by_path["/shard.tar"]
    message = str(raised.value)
    assert url in message and "1000000" in message and "neither ETag" in message, message
    assert gets == 1, gets


def test_shards_without_validator_are_one_get_each(http, dataset):
    http.reset(Faults(no_validator=True))
    ds = StreamingDataset(http_spec(http, dataset), s3={"part_size": 4096}, shuffle_buffer=0)
    assert_identical_to_local(collect(loader(ds, 2)), dataset)
    assert http.served.body_bytes == shard_bytes(dataset)
    assert sorted(http.served.gets_by_path.values()) == [1] * len(dataset.paths)
    assert all("range" not in h for h in http.served.headers)


def test_an_answer_in_a_content_coding_is_an_error_naming_it(http, dataset):
    http.reset(Faults(gzip=True))
    url = http.url(dataset.paths[0].name)
    for fmt in ("raw", "tar"):
        with pytest.raises(shardstream.ShardReadError) as raised:
            collect(StreamingDataset(url, format=fmt, s3=FAST))
        message = str(raised.value)
        assert url in message and "gzip" in message, message
    assert http.served.headers
    assert all(h.get("accept-encoding") == "identity" for h in http.served.headers)


def test_a_server_that_ignores_range_is_read_by_one_answer(tmp_path):
    # Read with the default part queue: the first whole answer (200) to a
    # ranged GET is read on to the object's end, no part asks again; a cut
    # body is resumed once (the server's whole answer read past the bytes
    # before).
    root = tmp_path / "whole"
    expected = write_large_shard(root)
    with running_http_server(root) as server:
        server.reset(Faults(ignore_range=True, cut_first=1))
        ds = StreamingDataset(server.url("shard.tar"))
        got = {s["__key__"]: s["bin"] for s in ds}
        stats = ds.stats()
        gets = server.served.gets_by_path["/shard.tar"]
    assert got == expected
    assert stats["requests"] == 2 and stats["resumed_bodies"] == 1, stats
    assert gets <= 3, gets  # the two reads, and at most one to learn the size


def reading_threads() -> int:
    """Native threads of shardstream streams in this process."""
    names = (task / "comm" for task in Path("/proc/self/task").iterdir())
    return sum(name.read_text().startswith("shardstream") for name in names if name.exists())


def test_a_read_by_one_answer_ends_when_its_iterator_is_dropped(tmp_path):
    # Parts wait their turn on the one body; dropping the iterator mid-shard
    # ends them, the body and the stream's threads.
    root = tmp_path / "whole"
    write_large_shard(root)
    with running_http_server(root) as server:
        server.reset(Faults(ignore_range=True))
        ds = StreamingDataset(server.url("shard.tar"), read_ahead_bytes=1 << 20)
        iterator = iter(ds)
        assert len([next(iterator) for _ in range(5)]) == 5
        assert reading_threads() > 0
        del iterator, ds
        deadline = time.monotonic() + 10
        while reading_threads() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert reading_threads() == 0
        assert server.served.gets == 1


def test_a_server_that_ignores_range_and_changes_mid_read_is_an_error(tmp_path):
    # The cut falls in a later part, read from the first answer's body; the
    # resume is pinned to the first ETag.
    root = tmp_path / "whole"
    write_large_shard(root)
    with running_http_server(root) as server:
        server.reset(
            Faults(ignore_range=True, cut_first=1, cut_after=1_000_000, change_on_cut=True)
        )
        url = server.url("shard.tar")
        with pytest.raises(shardstream.ObjectChangedError) as raised:
            collect(StreamingDataset(url, s3=FAST))
    message = str(raised.value)
    assert url in message and "1000000" in message, message


def test_a_server_that_ignores_range_with_a_short_body_is_an_error_at_its_end(tmp_path):
    root = tmp_path / "whole"
    write_large_shard(root)
    size = (root / "shard.tar").stat().st_size
    with running_http_server(root) as server:
        server.reset(Faults(ignore_range=True, short_by=100))
        url = server.url("shard.tar")
        with pytest.raises(shardstream.ShardReadError) as raised:
            collect(StreamingDataset(url, s3=FAST))
    message = str(raised.value)
    assert url in message and f"byte offset {size}" in message, message


def test_an_object_changed_mid_read_is_an_error(http, dataset, tmp_path):
    root = tmp_path / "changing"
    root.mkdir()
    (root / "shard.tar").write_bytes(dataset.paths[0].read_bytes())
    with running_http_server(root) as server:
        server.reset(Faults(cut_first=1, cut_after=3000, change_on_cut=True))
        url = server.url("shard.tar")
        ds = StreamingDataset(url, s3={"max_concurrency": 1})
        with pytest.raises(shardstream.ObjectChangedError) as raised:
            collect(ds)
    message = str(raised.value)
    assert url in message and "3000" in message, message


def test_a_server_that_never_answers_is_an_error_within_a_bound(http, dataset):
    http.reset(Faults(hang=True))
    url = http.url(dataset.paths[0].name)
    ds = StreamingDataset(url, s3={**FAST, "max_attempts": 2})
    started = time.monotonic()
    with pytest.raises(shardstream.ShardReadError) as raised:
        collect(ds)
    assert time.monotonic() - started < 20
    message = str(raised.value)
    assert url in message and "no response within" in message, message


def test_a_body_shorter_than_its_content_length_is_an_error_not_a_shorter_shard(http, dataset):
    http.reset(Faults(short_by=100))
    url = http.url(dataset.paths[0].name)
    size = dataset.paths[0].stat().st_size
    ds = StreamingDataset(url, s3={**FAST, "max_concurrency": 1})
    with pytest.raises(shardstream.ShardReadError) as raised:
        collect(ds)
    message = str(raised.value)
    assert url in message and f"byte offset {size}" in message, message


@pytest.mark.parametrize(
    ("faults", "error", "words"),
    [
        (Faults(), shardstream.ShardNotFoundError, "HTTP 404"),
        (Faults(forbidden=True), shardstream.StorageAuthError, "HTTP 403"),
        (Faults(require=("Authorization", "Bearer x")), shardstream.StorageAuthError, "HTTP 401"),
    ],
)
def test_refusals_name_the_url(http, dataset, faults, error, words):
    http.reset(faults)
    name = "missing.tar" if words == "HTTP 404" else dataset.paths[0].name
    url = http.url(name)
    with pytest.raises(error) as raised:
        collect(StreamingDataset(url, s3=FAST))
    assert url in str(raised.value) and words in str(raised.value)


def test_headers_are_sent_and_never_shown(http, dataset):
    secret = "Bearer s3cr3t-t0ken"
    http.reset(Faults(require=("Authorization", secret)))
    spec = http_spec(http, dataset)
    ds = StreamingDataset(spec, http_headers={"Authorization": secret})
    assert_identical_to_local(collect(loader(ds, 2)), dataset)
    assert secret not in repr(ds) and secret not in repr(ds.options)
    assert "Authorization" in repr(ds.options)
    missing = StreamingDataset(http.url("nothing-here.tar"), http_headers={"Authorization": secret})
    http.reset()
    with pytest.raises(shardstream.ShardNotFoundError) as raised:
        collect(missing)
    assert secret not in str(raised.value)
    with pytest.raises(ValueError, match="http_headers") as bad:
        StreamingDataset(spec, http_headers={"Authorization": secret + "\n"})
    assert secret not in str(bad.value)
    with pytest.raises(TypeError, match="http_headers"):
        StreamingDataset(spec, http_headers={"X-Count": 3})


def test_redirects_are_followed_within_a_bound(http, dataset, tmp_path):
    name = dataset.paths[0].name
    keys = dataset.keys_of([str(dataset.paths[0])])
    samples = collect(StreamingDataset(http.url(f"redirect/3/{name}")))
    assert Counter(s["__key__"] for s in samples) == Counter(keys)
    # The headers go to the shard's own host only: not across a redirect
    # to another one.
    with running_http_server(dataset.root) as cdn:
        http.redirect_to = cdn.base_url
        try:
            headers = {"X-Secret": "abc", "Authorization": "Bearer abc"}
            ds = StreamingDataset(http.url(name), http_headers=headers)
            assert len(collect(ds)) == len(keys)
        finally:
            http.redirect_to = None
        assert cdn.served.headers
        assert all("x-secret" not in h and "authorization" not in h for h in cdn.served.headers)
    with pytest.raises(shardstream.ShardReadError, match="more than 10 redirects"):
        collect(StreamingDataset(http.url(f"redirect/11/{name}"), s3=FAST))


def test_unknown_schemes_list_the_supported_ones():
    with pytest.raises(shardstream.DatasetSpecError) as raised:
        StreamingDataset("ftp://example.com/shard.tar")
    message = str(raised.value)
    for scheme in ("s3://", "http://", "https://", "hf://"):
        assert scheme in message, message


@pytest.mark.parametrize(
    "url", ["https://example.com/data/", "http://127.0.0.1:9/train/?page=1", "https://example.com"]
)
def test_a_folder_url_is_refused_at_construction(url):
    # HTTP has no listing: a folder would fail later as "not a tar archive".
    with pytest.raises(shardstream.DatasetSpecError) as raised:
        StreamingDataset(url)
    message = str(raised.value)
    assert url in message and "folder" in message, message
    for scheme in ("s3://", "gs://", "hf://"):
        assert scheme in message, message


def test_index_over_http_gives_ranks_equal_lengths_exactly_once(http, dataset, tmp_path):
    manifest = tmp_path / "manifest.json"
    spec = http_spec(http, dataset)
    proc = shardstream_cli("index", spec, "-o", manifest)
    assert proc.returncode == 0, proc.stderr
    entries = json.loads(manifest.read_text())["shards"]
    assert [e["url"] for e in entries] == [http.url(p.name) for p in dataset.paths]
    assert [e["size"] for e in entries] == [p.stat().st_size for p in dataset.paths]
    assert all(e["etag"] for e in entries)
    # Two ranks of two DataLoader workers each: every sample exactly once,
    # the same number per rank (96 samples: none dropped).
    total = len(dataset.keys)
    assert total % 2 == 0
    http.reset()
    keys = []
    for rank in range(2):
        ds = StreamingDataset(spec, manifest=str(manifest), rank=rank, world_size=2, seed=3)
        assert len(ds) == total // 2
        got = [s["__key__"] for s in collect(loader(ds, 2))]
        assert len(got) == total // 2
        keys += got
    assert_exactly_once(keys, dataset.keys)
    # The samples' spans only (not the tar's closing blocks), each once.
    assert http.served.body_bytes <= shard_bytes(dataset)
    assert all(n == 1 for n in http.served.gets_by_path.values())


def resumable(spec: str) -> StatefulDataLoader:
    ds = StreamingDataset(spec, seed=5, shuffle_buffer=7)
    return StatefulDataLoader(ds, batch_size=4, num_workers=2, collate_fn=key_batch, timeout=120)


def test_exact_resume_mid_epoch(http, dataset):
    spec = http_spec(http, dataset)
    full = collect(resumable(spec))
    assert_exactly_once([k for batch in full for k in batch], dataset.keys)
    k = len(full) // 2
    first = resumable(spec)
    iterator = iter(first)
    prefix = [next(iterator) for _ in range(k)]
    state = json.loads(json.dumps(first.state_dict()))
    del iterator, first
    resumed = resumable(spec)
    resumed.load_state_dict(state)
    assert prefix + collect(resumed) == full


def epoch_head_and_state(spec: str, shuffle: int, n: int) -> tuple[list[str], list[str], dict]:
    """The keys of a whole epoch of ``spec`` (seed 5, a shuffle buffer of
    ``shuffle``), those of the first ``n`` samples of another reading, and
    that reading's state after them (through JSON)."""
    full = [s["__key__"] for s in StreamingDataset(spec, seed=5, shuffle_buffer=shuffle)]
    first = StreamingDataset(spec, seed=5, shuffle_buffer=shuffle)
    iterator = iter(first)
    prefix = [next(iterator)["__key__"] for _ in range(n)]
    return full, prefix, json.loads(json.dumps(first.state_dict()))


def test_a_resume_on_one_rank_reads_no_manifest_the_run_did_not(tmp_path):
    """One rank over shards named by URL plans by what it listed; the
    manifest beside them is read only where counts are needed. Loading a
    state must not read it either: its sizes made the state "another
    dataset (the shard list differs)" (and its request could fail)."""
    root = tmp_path / "served"
    write_uneven_dataset(root, (5, 9, 4), prefix="shard")
    with running_http_server(root) as server:
        spec = server.shard_spec(3)
        proc = shardstream_cli("index", spec, "-o", root / "manifest.json")
        assert proc.returncode == 0, proc.stderr
        full, prefix, state = epoch_head_and_state(spec, 4, 7)
        server.reset()
        resumed = StreamingDataset(spec, seed=5, shuffle_buffer=4)
        resumed.load_state_dict(state)
        assert "/manifest.json" not in server.served.gets_by_path
        rest = [s["__key__"] for s in resumed]
    assert len(full) == 18
    assert prefix + rest == full


def test_exact_resume_mid_shard_from_a_server_that_ignores_range(tmp_path):
    # Every read is one whole answer, its parts taking their bytes from it.
    root = tmp_path / "whole"
    expected = write_large_shard(root)
    with running_http_server(root) as server:
        server.reset(Faults(ignore_range=True))
        url = server.url("shard.tar")
        full, prefix, state = epoch_head_and_state(url, 7, 80)
        resumed = StreamingDataset(url, seed=5, shuffle_buffer=7)
        resumed.load_state_dict(state)
        rest = [s["__key__"] for s in resumed]
        requests = resumed.stats()["requests"]
    assert sorted(full) == sorted(expected)
    assert prefix + rest == full
    # The resumed shuffle buffer's samples and those after the cursor: the
    # shard is read twice, each time by one answer.
    assert requests <= 2, requests


def test_raw_objects_over_http_are_keyed_by_their_path(http, dataset, tmp_path: Path):
    ds = StreamingDataset(http.url(dataset.paths[0].name), format="raw")
    (sample,) = collect(ds)
    assert sample["__key__"] == "/" + dataset.paths[0].stem
    assert sample["tar"] == dataset.paths[0].read_bytes()


MIB = 1 << 20


@pytest.mark.parametrize(
    ("options", "low", "high"),
    [
        ({}, 40 * MIB, 64 * MIB),
        ({"num_workers": 2, "worker_id": 0}, 16 * MIB, 32 * MIB),
        ({"read_ahead_bytes": 32 * MIB}, 16 * MIB, 32 * MIB),
    ],
    ids=["alone", "one-of-two-workers", "explicit"],
)
def test_the_read_ahead_budget_is_64_mib_where_one_process_reads_else_32_each(
    tmp_path, options, low, high
):
    """``read_ahead_bytes=None``: a process that reads alone (no DataLoader
    workers) reads up to 64 MiB ahead of a consumer that waits; one of two
    workers, and an explicit 32 MiB, up to 32 MiB."""
    payload = bytes(range(256)) * 400  # 100 KiB
    for shard in range(8):
        members = [(f"s{shard}_{i:03d}.bin", payload) for i in range(100)]
        write_tar(tmp_path / f"shard-{shard}.tar", members)
    with running_http_server(tmp_path) as server:
        ds = StreamingDataset(f"{server.base_url}/shard-{{0..7}}.tar", shuffle_buffer=0, **options)
        samples = iter(ds)
        next(samples)
        deadline = time.monotonic() + 30
        while ds.stats()["read_ahead_peak_bytes"] < low and time.monotonic() < deadline:
            time.sleep(0.1)
        # Time to go past the bound, were the budget larger.
        time.sleep(1.0)
        peak = ds.stats()["read_ahead_peak_bytes"]
        del samples
    assert low <= peak <= high, peak


def test_read_ahead_budget_gives_the_budget_in_force_and_refuses_a_bad_one():
    from shardstream._core import read_ahead_budget

    assert [read_ahead_budget(None, workers) for workers in (0, 1, 2, 16)] == [
        64 * MIB,
        64 * MIB,
        32 * MIB,
        32 * MIB,
    ]
    assert read_ahead_budget(5 * MIB, 0) == read_ahead_budget(5 * MIB, 8) == 5 * MIB
    with pytest.raises(ValueError, match="read_ahead_bytes"):
        read_ahead_budget(0, 0)

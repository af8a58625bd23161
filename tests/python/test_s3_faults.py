"""S3 reads through a fault-injecting proxy (tests/python/fault_proxy.py)
in front of moto's server: throttling, resets, first-byte delays, cut and
stalled bodies. The output stays byte-identical to the source, the stats
count exactly the retries and resumes the proxy caused, an object replaced
mid-read raises, and every test ends within its bound."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _shardtest import read_tar_samples, sample_digest, tar_bytes
from fault_proxy import FaultProxy, Faults, running_fault_proxy
from s3_server import BUCKET, S3Server, s3_config

import shardstream
from shardstream import StreamingDataset

pytestmark = [pytest.mark.usefixtures("s3_credentials"), pytest.mark.timeout(120)]

# Faults hit every k-th request in arrival order, and requests of several
# objects and parts interleave, so one request may meet a few in a row:
# enough attempts that only a broken retry loop runs out.
FAST_RETRIES = {"max_attempts": 12, "max_retry_time": 60.0}


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[FaultProxy]:
    with running_fault_proxy(s3.endpoint_url) as running:
        yield running


def read_all(ds: StreamingDataset, num_workers: int = 0) -> list[dict[str, Any]]:
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers)
    return list(loader)


def assert_same_as_source(samples: list[dict[str, Any]], expected: dict, urls: list[str]) -> None:
    """Every sample of ``urls`` once, each byte-identical to the source."""
    wanted = [k for k, (u, _) in expected.items() if u in urls]
    assert Counter(s["__key__"] for s in samples) == Counter(wanted)
    for sample in samples:
        url, digest = expected[sample["__key__"]]
        assert (sample["__url__"], sample_digest(sample)) == (url, digest)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_slowdowns_and_resets_are_retried(proxy, s3_dataset, num_workers):
    proxy.reset(Faults(slowdown_every=3, reset_every=7))
    urls = s3_dataset["urls"]
    ds = StreamingDataset(urls, s3=s3_config(proxy.endpoint_url, **FAST_RETRIES))
    assert_same_as_source(read_all(ds, num_workers), s3_dataset["expected"], urls)
    stats, injected = ds.stats(), proxy.injected
    assert injected.slowdowns > 0 and injected.resets > 0
    # The HTTP client may itself resend a request whose connection closed
    # before any answer, so a reset costs us at most one retry.
    assert injected.slowdowns <= stats["retries"] <= injected.slowdowns + injected.resets
    assert stats["requests"] <= injected.gets
    assert stats["resumed_bodies"] == 0
    assert stats["bytes_read"] == sum(s3_dataset["sizes"].values())


@pytest.mark.parametrize("num_workers", [0, 2])
def test_cut_bodies_resume_from_the_last_byte_pinned_to_the_etag(proxy, s3_dataset, num_workers):
    cut_after = 10_000
    proxy.reset(Faults(cut_every=2, cut_after=cut_after))
    urls = s3_dataset["urls"]
    ds = StreamingDataset(urls, s3=s3_config(proxy.endpoint_url, **FAST_RETRIES))
    assert_same_as_source(read_all(ds, num_workers), s3_dataset["expected"], urls)
    stats, injected = ds.stats(), proxy.injected
    assert injected.cuts > 0
    assert stats["resumed_bodies"] == injected.cuts
    assert stats["retries"] == injected.cuts
    # Every byte fetched once: a resume asks for the rest only.
    assert stats["bytes_read"] == sum(s3_dataset["sizes"].values())
    # A resume asks for the rest from the last byte received, pinned to the ETag.
    resumes = [(r, m) for r, m in injected.ranged_gets if not r.startswith("bytes=0-")]
    assert len(resumes) == injected.cuts
    for range_header, if_match in resumes:
        start = int(range_header.removeprefix("bytes=").split("-")[0])
        assert start % cut_after == 0, range_header
        assert if_match and if_match.startswith('"'), "a resume must be pinned to the ETag"


def test_stalled_body_resumes_after_the_idle_timeout(proxy, s3_dataset):
    proxy.reset(Faults(stall_every=3, stall_seconds=3.0, cut_after=20_000))
    urls = s3_dataset["urls"][:4]
    ds = StreamingDataset(urls, s3=s3_config(proxy.endpoint_url, idle_timeout=0.5, **FAST_RETRIES))
    assert_same_as_source(read_all(ds), s3_dataset["expected"], urls)
    assert proxy.injected.stalls > 0
    assert ds.stats()["resumed_bodies"] == proxy.injected.stalls


def test_late_first_byte_times_out_and_is_retried(proxy, s3_dataset):
    proxy.reset(Faults(first_byte_delay=2.0, delay_every=2))
    urls = s3_dataset["urls"][:4]
    ds = StreamingDataset(
        urls, s3=s3_config(proxy.endpoint_url, first_byte_timeout=0.5, **FAST_RETRIES)
    )
    assert_same_as_source(read_all(ds), s3_dataset["expected"], urls)
    assert proxy.injected.delays > 0
    assert ds.stats()["retries"] == proxy.injected.delays


def test_parallel_ranged_gets_survive_every_fault(proxy, s3_dataset):
    proxy.reset(Faults(slowdown_every=5, cut_every=4, cut_after=5_000, reset_every=11))
    urls = s3_dataset["urls"][:3]
    options = s3_config(proxy.endpoint_url, part_size=16 << 10, max_concurrency=3, **FAST_RETRIES)
    ds = StreamingDataset(urls, s3=options, shuffle_buffer=0)
    assert_same_as_source(read_all(ds, 2), s3_dataset["expected"], urls)
    stats, injected = ds.stats(), proxy.injected
    assert injected.cuts > 0 and injected.slowdowns > 0
    # A reset may land on a connection with a cut body still unread.
    assert 0 < stats["resumed_bodies"] <= injected.cuts
    assert stats["retries"] >= injected.slowdowns + injected.cuts
    assert stats["retries"] <= injected.slowdowns + injected.cuts + injected.resets
    # Every part after the first (and every resume) is pinned to the first ETag.
    later = [m for r, m in injected.ranged_gets if not r.startswith("bytes=0-")]
    assert later and all(later)


def test_listing_is_retried_under_throttling(proxy, s3_dataset):
    proxy.reset(Faults(slowdown_first=2))
    ds = StreamingDataset(f"s3://{BUCKET}/audio/", s3=s3_config(proxy.endpoint_url))
    assert proxy.injected.slowdowns == 2
    assert [url for url, _ in ds.shards] == sorted(s3_dataset["urls"])


def page_of(
    first: list[bytes], answer: bytes, *, truncated: str | None, token: str | None
) -> bytes:
    """The first listing page (kept in ``first``), whatever ``answer`` is,
    with its ``IsTruncated`` and ``NextContinuationToken`` set as given
    (``None``: left out)."""
    first[:] = first or [answer]
    page = re.sub(
        rb"<IsTruncated>[^<]*</IsTruncated>|<NextContinuationToken>[^<]*"
        rb"</NextContinuationToken>",
        b"",
        first[0],
    )
    extra = b"" if truncated is None else f"<IsTruncated>{truncated}</IsTruncated>".encode()
    extra += (
        b"" if token is None else f"<NextContinuationToken>{token}</NextContinuationToken>".encode()
    )
    return page.replace(b"</ListBucketResult>", extra + b"</ListBucketResult>")


@pytest.mark.parametrize(
    ("truncated", "token", "says"),
    [
        ("true", None, "a page marked truncated gives no continuation token"),
        (None, "more", "a page not marked truncated gives a continuation token"),
        ("false", "more", "a page not marked truncated gives a continuation token"),
        ("true", "again", "the same continuation token was handed out twice"),
    ],
)
def test_a_listing_that_cannot_be_followed_to_its_end_is_an_error(
    proxy, s3_dataset, truncated, token, says
):
    """Before, the first two ended the listing (its first page only, the
    rest of the prefix left out without a word), and a token handed out
    again and again listed without end."""
    first: list[bytes] = []
    rewrite = functools.partial(page_of, first, truncated=truncated, token=token)
    proxy.reset(Faults(listing=rewrite))
    started = time.monotonic()
    with pytest.raises(shardstream.ShardReadError, match=says) as info:
        StreamingDataset(f"s3://{BUCKET}/audio/", s3=s3_config(proxy.endpoint_url))
    assert f"s3://{BUCKET}/audio/" in str(info.value)
    assert time.monotonic() - started < 30
    # An object listed without its size is an error naming it, not 0 bytes.
    proxy.reset(Faults(listing=lambda page: re.sub(rb"<Size>\d+</Size>", b"", page, count=1)))
    with pytest.raises(shardstream.ShardReadError, match="gives no size for the object"):
        StreamingDataset(f"s3://{BUCKET}/audio/", s3=s3_config(proxy.endpoint_url))


def test_an_empty_prefix_among_others_is_an_error(s3, s3_dataset):
    """Before, a prefix with no shard (a typo) among others was left out."""
    good = f"s3://{BUCKET}/audio/"
    with pytest.raises(shardstream.DatasetSpecError, match="no shard under the prefix"):
        StreamingDataset([good, f"s3://{BUCKET}/typo/"], s3=s3_config(s3))
    assert len(StreamingDataset([good], s3=s3_config(s3)).shards) == len(s3_dataset["urls"])


def test_head_requests_are_retried_under_throttling(proxy, s3_dataset, tmp_path):
    proxy.reset(Faults(slowdown_first=2))
    urls = s3_dataset["urls"][:2]
    manifest = tmp_path / "manifest.json"
    cli = ["shardstream", "--s3-endpoint-url", proxy.endpoint_url, "--s3-path-style"]
    assert shardstream._core.run_cli([*cli, "index", *urls, "-o", str(manifest)]) == 0
    assert proxy.injected.slowdowns == 2
    entries = json.loads(manifest.read_text())["shards"]
    assert [(e["url"], e["size"]) for e in entries] == [(u, s3_dataset["sizes"][u]) for u in urls]


def test_persistent_throttling_gives_up_within_the_bound(proxy, s3_dataset):
    proxy.reset(Faults(slowdown_every=1))
    url = s3_dataset["urls"][0]
    ds = StreamingDataset(url, s3=s3_config(proxy.endpoint_url, max_attempts=3))
    started = time.monotonic()
    with pytest.raises(shardstream.ShardReadError, match=r"gave up after 3 attempts.*SlowDown"):
        next(iter(ds))
    assert time.monotonic() - started < 30
    assert proxy.injected.slowdowns == 3
    with pytest.raises(shardstream.ShardReadError, match=url.replace(".", r"\.")):
        next(iter(StreamingDataset(url, s3=s3_config(proxy.endpoint_url, max_attempts=2))))


@pytest.mark.parametrize(("part_size", "cut_after"), [(None, 30_000), (8 << 10, 3_000)])
def test_object_replaced_mid_read_raises_and_never_mixes_versions(
    proxy, s3, s3_dataset, dataset, part_size, cut_after
):
    client = s3.client()
    source = dataset.paths[0].read_bytes()
    key = f"replaced/shard-{part_size}.tar"
    client.put_object(Bucket=BUCKET, Key=key, Body=source)
    url = f"s3://{BUCKET}/{key}"
    replaced = []

    def replace(path: str) -> None:
        if not replaced:
            # Another version of the same size: only the ETag can tell.
            client.put_object(Bucket=BUCKET, Key=key, Body=source[::-1])
            replaced.append(path)

    proxy.reset(Faults(cut_every=1, cut_after=cut_after, on_cut=replace))
    options = {"part_size": part_size, "max_concurrency": 2} if part_size else {}
    ds = StreamingDataset(
        url, s3=s3_config(proxy.endpoint_url, **options, **FAST_RETRIES), shuffle_buffer=0
    )
    original = {s.key: s.digest() for s in read_tar_samples(dataset.paths[0], url)}
    got = []
    with pytest.raises(shardstream.ObjectChangedError, match=key.replace(".", r"\.")):
        for sample in ds:
            got.append(sample)
    assert replaced, f"the proxy never cut a body: {proxy.injected}"
    for sample in got:
        assert sample_digest(sample) == original[sample["__key__"]]
    assert len(got) < len(original)


@pytest.mark.parametrize("max_concurrency", [1, 4])
def test_objects_are_fetched_concurrently_and_delivered_in_order(
    proxy, s3_dataset, max_concurrency
):
    proxy.reset(Faults(first_byte_delay=0.2))
    urls = s3_dataset["urls"]
    options = s3_config(proxy.endpoint_url, max_concurrency=max_concurrency)
    ds = StreamingDataset(urls, s3=options, shuffle_buffer=0, shuffle_shards=False)
    keys = [s["__key__"] for s in read_all(ds)]
    in_order = [k for url in urls for k, (u, _) in s3_dataset["expected"].items() if u == url]
    assert keys == in_order
    # One object at a time, or several objects' first bytes awaited at once.
    if max_concurrency == 1:
        assert proxy.injected.max_active == 1
    else:
        assert 1 < proxy.injected.max_active <= max_concurrency
    assert ds.stats()["bytes_read"] == sum(s3_dataset["sizes"].values())


def test_one_large_objects_parts_are_in_flight_together_at_the_default_part_size(
    proxy, s3, s3_dataset
):
    """With the default part size (8 MiB) larger than an object's share of
    a small read-ahead budget, parts shrink so that several fit in the share
    and go in parallel, rather than one at a time."""
    members = [(f"p{i:03d}.bin", bytes([i]) * (64 << 10)) for i in range(32)]
    key = "parts/one.tar"
    s3.client().put_object(Bucket=BUCKET, Key=key, Body=tar_bytes(members))
    proxy.reset(Faults(first_byte_delay=0.05))
    options = s3_config(proxy.endpoint_url, max_concurrency=4)
    ds = StreamingDataset(
        f"s3://{BUCKET}/{key}", s3=options, read_ahead_bytes=4 << 20, shuffle_buffer=0
    )
    samples = {s["__key__"]: s["bin"] for s in read_all(ds)}
    assert samples == {name.removesuffix(".bin"): data for name, data in members}
    # A 4 MiB budget shared by 4 objects: 1 MiB each, so 256 KiB parts, 4 at
    # a time, for the 2 MiB object (before: 1 MiB parts, one at a time).
    assert ds.stats()["requests"] >= 8
    assert 1 < proxy.injected.max_active <= 4


# --------------------------------------------------------------------------
# Wrong answers to Range requests: a resumed body or a part is taken only
# as exactly the bytes asked for.
# --------------------------------------------------------------------------

# 200 samples of 1 KiB, each different, so that bytes from another offset
# cannot pass for the right ones.
MEMBERS_200 = [(f"s{i:03d}.bin", hashlib.sha256(str(i).encode()).digest() * 32) for i in range(200)]
CUT_AFTER = 50_000
BAD_ANSWERS = {
    "whole_on_range": "whole_answers",
    "shifted_on_range": "shifted_answers",
    "short_on_range": "short_answers",
}


@pytest.fixture
def shard_200(s3: S3Server, s3_dataset) -> tuple[str, dict[str, bytes]]:
    """A 200-sample shard under ``s3://train/resume/`` (in the bucket that
    ``s3_dataset`` makes): its URL and samples."""
    key = "resume/shard-200.tar"
    s3.client().put_object(Bucket=BUCKET, Key=key, Body=tar_bytes(MEMBERS_200))
    return f"s3://{BUCKET}/{key}", {name.split(".")[0]: data for name, data in MEMBERS_200}


@pytest.mark.parametrize("bad", list(BAD_ANSWERS))
@pytest.mark.parametrize("listed", [False, True], ids=["named", "listed"])
def test_a_wrong_answer_to_a_resume_is_refused_and_the_shard_arrives_whole(
    proxy, shard_200, bad, listed
):
    """The body is cut, and the resume's answer is the whole object (200),
    a range from another offset, or half the range asked for: it is refused
    and asked for again, and the shard arrives whole and unchanged (before,
    the object's first bytes landed in the middle of the shard)."""
    url, expected = shard_200
    spec = f"s3://{BUCKET}/resume/" if listed else url
    options = s3_config(proxy.endpoint_url, max_concurrency=1, **FAST_RETRIES)
    ds = StreamingDataset(spec, s3=options, shuffle_buffer=0)
    proxy.reset(Faults(cut_first=1, cut_after=CUT_AFTER, **{bad: 1}))
    samples = [(s["__key__"], s["bin"]) for s in ds]
    assert samples == list(expected.items())
    injected = proxy.injected
    assert injected.cuts == 1 and getattr(injected, BAD_ANSWERS[bad]) == 1
    # The cut, then the wrong answer, each cost one retry.
    stats = ds.stats()
    assert (stats["resumed_bodies"], stats["retries"]) == (1, 2)


@pytest.mark.parametrize("bad", ["whole_on_range", "shifted_on_range"])
def test_a_resume_always_answered_wrongly_is_an_error_naming_the_shard_and_offset(
    proxy, shard_200, bad
):
    url, expected = shard_200
    proxy.reset(Faults(cut_first=1, cut_after=CUT_AFTER, **{bad: 1000}))
    options = s3_config(proxy.endpoint_url, max_concurrency=1, max_attempts=3)
    ds = StreamingDataset(url, s3=options, shuffle_buffer=0)
    got = []
    started = time.monotonic()
    with pytest.raises(shardstream.ShardReadError) as info:
        for sample in ds:
            got.append(sample)
    assert time.monotonic() - started < 30
    message = str(info.value)
    assert url in message and f"byte offset {CUT_AFTER}" in message, message
    assert "gave up after 3 attempts" in message, message
    # What came before the error is right, and is not the whole shard.
    assert 0 < len(got) < len(expected)
    assert all(s["bin"] == expected[s["__key__"]] for s in got)


@pytest.mark.parametrize("bad", list(BAD_ANSWERS))
def test_wrong_answers_to_ranged_part_gets_are_refused(proxy, shard_200, bad):
    """Parts after the first are ranged GETs from past byte 0: a part
    answered with the whole object, another range or half of its range is
    asked for again, and the shard arrives whole."""
    url, expected = shard_200
    proxy.reset(Faults(**{bad: 2}))
    options = s3_config(proxy.endpoint_url, part_size=32 << 10, max_concurrency=3, **FAST_RETRIES)
    ds = StreamingDataset(url, s3=options, shuffle_buffer=0)
    samples = [(s["__key__"], s["bin"]) for s in ds]
    assert samples == list(expected.items())
    assert getattr(proxy.injected, BAD_ANSWERS[bad]) == 2
    assert ds.stats()["retries"] == 2

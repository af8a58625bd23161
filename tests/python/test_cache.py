"""The local cache of remote shards (``cache_dir=``, ``cache_limit_bytes=``)
against a real HTTP server on 127.0.0.1 that counts its GETs, and moto's S3:
epoch 2 makes no request and another process only one first-byte GET per
shard (its identity check), output is byte-identical with and without the
cache, an object replaced at the same URL is never served from the cache,
two processes fill one cache at once, eviction keeps the limit and spares a
file being read, a damaged copy is fetched again, an open reads the copy
once, a cache that cannot be written (a file size limit, a shard over the
limit) falls back to streaming, and a link planted in the cache directory
is never followed."""

from __future__ import annotations

import fcntl
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from _shardtest import (
    DatasetInfo,
    assert_exactly_once,
    collect,
    in_new_process,
    loader,
    read_texts,
    sample_digest,
)
from http_server import HttpServer, running_http_server
from s3_server import BUCKET
from s3_server import s3_config as config

from shardstream import StreamingDataset

pytestmark = pytest.mark.timeout(120)

# A copy ends with the validator it was filled under, then this tail:
# validator length (u32), shard size (u64), CRC-32 (u32), magic (8 bytes).
TAIL = 24


def http_spec(server: HttpServer, dataset: DatasetInfo) -> str:
    return server.shard_spec(len(dataset.paths))


def digests(samples: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {s["__key__"]: sample_digest(s) for s in samples}


@pytest.fixture(scope="module")
def local(dataset: DatasetInfo) -> dict[str, dict[str, str]]:
    return digests(collect(StreamingDataset(dataset.spec)))


def cached_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.shard"))


def copied_bytes(file: Path) -> bytes:
    """The shard's bytes in a cached copy (what precedes its validator)."""
    data = file.read_bytes()
    tail = data[-TAIL:]
    assert tail[-8:] == b"SSCACHE2", file
    validator_len = int.from_bytes(tail[:4], "little")
    size = int.from_bytes(tail[4:12], "little")
    assert size + validator_len + TAIL == len(data), file
    return data[:size]


def assert_copies_of(cache: Path, dataset: DatasetInfo) -> None:
    """Every cached file is a shard's bytes followed by the trailer."""
    originals = {p.read_bytes() for p in dataset.paths}
    files = cached_files(cache)
    assert files
    for file in files:
        assert copied_bytes(file) in originals, file
    assert not list(cache.glob(".tmp-*")), "no temporary file is left behind"


def identity_gets(server: HttpServer) -> int:
    """GETs of a first byte: the identity checks of cached copies."""
    return sum(1 for h in server.served.headers if h.get("range") == "bytes=0-0")


def body_gets(server: HttpServer) -> int:
    """GETs of shard bytes: the identity checks, and the look for a
    ``manifest.json`` beside the shards when a dataset is made, left out."""
    looks = server.served.gets_by_path["/manifest.json"]
    return server.served.gets - identity_gets(server) - looks


def test_epoch_two_makes_no_get_and_output_is_identical(http, dataset, local, tmp_path):
    cache = tmp_path / "cache"
    ds = StreamingDataset(http_spec(http, dataset), cache_dir=str(cache), shuffle_buffer=8)
    http.reset()
    first = collect(ds)
    assert http.served.gets >= len(dataset.paths)
    assert_exactly_once([s["__key__"] for s in first], dataset.keys)
    assert digests(first) == local
    assert len(cached_files(cache)) == len(dataset.paths)
    assert_copies_of(cache, dataset)

    http.reset()
    second = collect(ds)
    assert http.served.gets == 0, http.served.gets_by_path
    assert digests(second) == local
    assert all(s["__url__"].startswith("http://127.0.0.1:") for s in second)

    # Other processes of the node (DataLoader workers) read the same copies,
    # each checking the identity of the shards it opens once.
    http.reset()
    again = collect(loader(ds, 2))
    assert body_gets(http) == 0, http.served.gets_by_path
    assert identity_gets(http) == len(dataset.paths), http.served.gets_by_path
    assert_exactly_once([s["__key__"] for s in again], dataset.keys)
    assert digests(again) == local


FILL = textwrap.dedent(
    """
    import hashlib, json, sys
    sys.path[:0] = sys.argv[3:]
    from _shardtest import sample_digest
    from shardstream import StreamingDataset
    ds = StreamingDataset(sys.argv[1], cache_dir=sys.argv[2], shuffle_buffer=4)
    print(json.dumps({s["__key__"]: sample_digest(s) for s in ds}))
    """
)


def fill_process(spec: str, cache: Path, **kwargs: Any) -> subprocess.Popen[str]:
    here = Path(__file__).parent
    return subprocess.Popen(
        [sys.executable, "-c", FILL, spec, str(cache), str(here), *sys.path],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def test_two_processes_fill_one_cache_at_once(http, dataset, local, tmp_path):
    cache = tmp_path / "cache"
    spec = http_spec(http, dataset)
    running = [fill_process(spec, cache) for _ in range(2)]
    for process in running:
        out, err = process.communicate(timeout=90)
        assert process.returncode == 0, err
        assert json.loads(out) == local
    assert len(cached_files(cache)) == len(dataset.paths)
    assert_copies_of(cache, dataset)
    ds = StreamingDataset(spec, cache_dir=str(cache))
    http.reset()
    assert digests(collect(ds)) == local
    assert body_gets(http) == 0
    assert identity_gets(http) <= len(dataset.paths)


def test_eviction_keeps_the_limit_and_spares_a_file_being_read(http, dataset, local, tmp_path):
    cache = tmp_path / "cache"
    largest = max(p.stat().st_size for p in dataset.paths) + TAIL + 64
    limit = 3 * largest
    spec = http_spec(http, dataset)
    ds = StreamingDataset(spec, cache_dir=str(cache), cache_limit_bytes=limit, shuffle_shards=False)
    assert digests(collect(ds)) == local
    files = cached_files(cache)
    assert 1 <= len(files) <= 3
    assert sum(f.stat().st_size for f in files) <= limit
    # A file being read (its shared lock held) is never evicted, even when
    # it is the least recently used.
    oldest = min(files, key=lambda f: f.stat().st_atime_ns)
    with oldest.open("rb") as held:
        fcntl.flock(held, fcntl.LOCK_SH)
        reshuffled = StreamingDataset(spec, cache_dir=str(cache), cache_limit_bytes=limit, seed=99)
        assert digests(collect(reshuffled)) == local
        assert oldest.exists()
    files = cached_files(cache)
    assert sum(f.stat().st_size for f in files) <= limit + largest
    assert_copies_of(cache, dataset)


def test_a_damaged_copy_is_removed_and_fetched_again(http, dataset, local, tmp_path):
    cache = tmp_path / "cache"
    ds = StreamingDataset(http_spec(http, dataset), cache_dir=str(cache))
    collect(ds)
    flipped, cut = cached_files(cache)[:2]
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    with cut.open("r+b") as f:
        f.truncate(cut.stat().st_size - 100)
    http.reset()
    assert digests(collect(ds)) == local
    assert 2 <= http.served.gets <= 2 * 2, http.served.gets_by_path
    assert len(http.served.gets_by_path) == 2
    assert len(cached_files(cache)) == len(dataset.paths)
    assert_copies_of(cache, dataset)
    http.reset()
    assert digests(collect(ds)) == local
    assert http.served.gets == 0


READ_FROM_CACHE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    sys.path[:0] = sys.argv[3:]
    from shardstream import StreamingDataset

    def rchar() -> int:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
        raise AssertionError("no rchar in /proc/self/io")

    # The second pass's end would start the next epoch's reads (its first
    # cache hit could land before the counters are read).
    ds = StreamingDataset(
        sys.argv[1], cache_dir=sys.argv[2], shuffle_buffer=0, read_next_epoch_early=False
    )
    warm = sum(1 for _ in ds)
    before, stats_before = rchar(), ds.stats()
    samples = sum(1 for _ in ds)
    read = rchar() - before
    stats = ds.stats()
    print(json.dumps({
        "warm": warm,
        "samples": samples,
        "rchar": read,
        **{name: stats[name] - stats_before[name] for name in stats},
    }))
    """
)


def test_an_open_from_the_cache_reads_the_copy_once(http, dataset, tmp_path):
    """Opening a cached copy that is in the page cache (just written) checks
    its CRC-32 over mappings of it, which the read of the shard then maps
    again: the process reads no byte of the copies with ``read()`` (only
    their trailers), and delivers each shard's bytes exactly once."""
    cache = tmp_path / "cache"
    spec = http_spec(http, dataset)
    collect(StreamingDataset(spec, cache_dir=str(cache)))
    assert len(cached_files(cache)) == len(dataset.paths)
    shard_bytes = sum(p.stat().st_size for p in dataset.paths)
    http.reset()
    process = subprocess.run(
        [sys.executable, "-c", READ_FROM_CACHE, spec, str(cache), *sys.path],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert process.returncode == 0, process.stderr
    measured = json.loads(process.stdout)
    assert body_gets(http) == 0, http.served.gets_by_path
    assert identity_gets(http) == len(dataset.paths), "one check per shard and process"
    assert measured["samples"] == measured["warm"] == len(dataset.keys)
    assert measured["cache_bytes"] == shard_bytes
    assert measured["cache_hits"] == len(dataset.paths)
    assert measured["bytes_read"] == measured["requests"] == 0
    # Reading the copies through read() as well would take shard_bytes.
    slack = 64 << 10
    assert shard_bytes > 4 * slack
    assert measured["rchar"] < slack, (measured, shard_bytes)


@pytest.mark.usefixtures("s3_credentials")
def test_s3_shards_are_cached_under_their_listed_etag(s3, s3_dataset, tmp_path):
    cache = tmp_path / "cache"
    spec = f"s3://{BUCKET}/audio/"
    expected = {key: digest for key, (_, digest) in s3_dataset["expected"].items()}
    first = StreamingDataset(spec, s3=config(s3), cache_dir=str(cache))
    assert digests(collect(first)) == expected
    assert first.stats()["requests"] >= len(s3_dataset["urls"])
    assert len(cached_files(cache)) == len(s3_dataset["urls"])
    second = StreamingDataset(spec, s3=config(s3), cache_dir=str(cache))
    assert digests(collect(second)) == expected
    # A new dataset checks each object's identity again (one HEAD), and
    # reads every shard from its copy.
    stats = second.stats()
    assert stats["requests"] == stats["cache_hits"] == len(s3_dataset["urls"])
    assert stats["bytes_read"] == 0


def test_a_cache_dir_that_cannot_be_made_is_refused_at_construction(dataset, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(ValueError) as raised:
        StreamingDataset(dataset.spec, cache_dir=str(blocker / "cache"))
    message = str(raised.value)
    assert "cache_dir" in message and str(blocker) in message, message


def test_a_shard_over_the_limit_is_streamed_not_cached(http, dataset, local, tmp_path, capfd):
    cache = tmp_path / "cache"
    smallest = min(p.stat().st_size for p in dataset.paths)
    ds = StreamingDataset(
        http_spec(http, dataset), cache_dir=str(cache), cache_limit_bytes=smallest // 2
    )
    assert digests(collect(ds)) == local
    assert cached_files(cache) == []
    assert not list(cache.glob(".tmp-*"))
    assert "more than cache_limit_bytes; streamed, not cached" in capfd.readouterr().err


def test_a_write_that_fails_falls_back_to_streaming(http, dataset, local, tmp_path):
    # A file size limit makes every write past it fail (EFBIG), as a full
    # disk would (ENOSPC): the shards still stream, whole.
    cache = tmp_path / "cache"
    smallest = min(p.stat().st_size for p in dataset.paths)

    def limit_file_size() -> None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (smallest // 2, smallest // 2))

    process = fill_process(http_spec(http, dataset), cache, preexec_fn=limit_file_size)
    out, err = process.communicate(timeout=90)
    assert process.returncode == 0, err
    assert json.loads(out) == local
    assert "cannot write to the cache" in err
    assert cached_files(cache) == []
    assert not list(cache.glob(".tmp-*"))


def test_an_epoch_stopped_early_leaves_only_complete_copies(http, dataset, tmp_path):
    cache = tmp_path / "cache"
    ds = StreamingDataset(http_spec(http, dataset), cache_dir=str(cache), read_ahead_bytes=4096)
    iterator = iter(ds)
    next(iterator)
    del iterator
    assert not list(cache.glob(".tmp-*"))
    if cached_files(cache):
        assert_copies_of(cache, dataset)


def _kind_in_worker(sample: dict[str, Any]) -> tuple[str, str, bytes]:
    """What a DataLoader worker hands on for the long member."""
    return sample["__key__"], type(sample["bin"]).__name__, bytes(sample["bin"])


def test_members_of_a_cached_copy_leave_workers_as_bytes_not_references(tmp_path):
    """A local shard's long members leave DataLoader workers by reference to
    the file; a cached copy's must not (eviction may delete the copy before
    the main process reads it): they leave through shared memory, like a
    streamed shard's, and their bytes are the same."""
    import io
    import tarfile

    from torch.utils.data import DataLoader

    root = tmp_path / "shards"
    root.mkdir()
    blobs = {f"{i:04d}": bytes([i]) * (64 << 10) for i in range(4)}
    with tarfile.open(root / "shard-000000.tar", "w") as tar:
        for key, blob in blobs.items():
            info = tarfile.TarInfo(f"{key}.bin")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))

    def kinds(spec: str, **options: Any) -> dict[str, tuple[str, bytes]]:
        ds = StreamingDataset(spec, shuffle_buffer=0, **options)
        dl = DataLoader(ds, batch_size=None, num_workers=1, collate_fn=_kind_in_worker)
        return {key: (kind, blob) for key, kind, blob in dl}

    local_kinds = kinds(str(root / "shard-000000.tar"))
    assert {kind for kind, _ in local_kinds.values()} == {"LocalBytes"}

    cache = tmp_path / "cache"
    with running_http_server(root) as server:
        spec = server.url("shard-000000.tar")
        first = kinds(spec, cache_dir=str(cache))
        server.reset()
        second = kinds(spec, cache_dir=str(cache))
        assert body_gets(server) == 0
    assert len(cached_files(cache)) == 1
    for got in (first, second):
        assert {kind for kind, _ in got.values()} == {"SharedBytes"}
        assert {key: blob for key, (_, blob) in got.items()} == blobs


# A symbolic link planted in the cache directory (by anyone who may write
# there, a shared /tmp) never makes shardstream write, truncate or read the
# file it points to, and a cache directory shardstream makes is private.

PRECIOUS = b"a file outside the cache that must stay as it is\n"


def outside_file(tmp_path: Path) -> Path:
    outside = tmp_path / "outside" / "precious.txt"
    outside.parent.mkdir()
    outside.write_bytes(PRECIOUS)
    return outside


def test_a_link_planted_as_the_eviction_lock_is_not_followed(http, dataset, local, tmp_path):
    outside = outside_file(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / ".evict.lock").symlink_to(outside)
    largest = max(p.stat().st_size for p in dataset.paths)
    ds = StreamingDataset(
        http_spec(http, dataset), cache_dir=str(cache), cache_limit_bytes=10 * largest
    )
    assert digests(collect(ds)) == local
    assert outside.read_bytes() == PRECIOUS
    assert len(cached_files(cache)) == len(dataset.paths)
    assert not (cache / ".evict.lock").is_symlink()


PLANT_THEN_OPEN = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    sys.path[:0] = sys.argv[4:]
    from _shardtest import sample_digest
    from shardstream import StreamingDataset
    cache, outside = Path(sys.argv[2]), sys.argv[3]
    # Links under every name a process could guess from its id.
    pid = os.getpid()
    for name in [f".tmp-{pid}-probe", *(f".tmp-{pid}-{n}" for n in range(64))]:
        (cache / name).symlink_to(outside)
    ds = StreamingDataset(sys.argv[1], cache_dir=str(cache), shuffle_buffer=0)
    print(json.dumps({s["__key__"]: sample_digest(s) for s in ds}))
    """
)


def test_links_planted_at_guessable_temporary_names_are_not_followed(
    http, dataset, local, tmp_path
):
    outside = outside_file(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    process = subprocess.run(
        [
            sys.executable,
            "-c",
            PLANT_THEN_OPEN,
            http_spec(http, dataset),
            str(cache),
            str(outside),
            str(Path(__file__).parent),
            *sys.path,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert process.returncode == 0, process.stderr
    assert json.loads(process.stdout) == local
    assert outside.read_bytes() == PRECIOUS
    planted = [p for p in cache.glob(".tmp-*") if p.is_symlink()]
    assert len(planted) == 65, "the planted links are left as they are"
    for link in planted:
        link.unlink()
    # The temporary files have names of their own: the shards were cached.
    assert len(cached_files(cache)) == len(dataset.paths)
    assert_copies_of(cache, dataset)


def test_a_cached_copy_that_is_a_link_is_not_followed_but_fetched_again(
    http, dataset, local, tmp_path
):
    cache = tmp_path / "cache"
    spec = http_spec(http, dataset)
    collect(StreamingDataset(spec, cache_dir=str(cache)))
    entry = cached_files(cache)[0]
    copied = entry.read_bytes()
    original = next(p for p in dataset.paths if copied.startswith(p.read_bytes()))
    # The link points at a file outside that holds a valid copy: following
    # it would serve whatever that file holds, with no request.
    outside = tmp_path / "outside.shard"
    outside.write_bytes(entry.read_bytes())
    before = outside.read_bytes()
    entry.unlink()
    entry.symlink_to(outside)
    http.reset()
    ds = StreamingDataset(spec, cache_dir=str(cache))
    assert digests(collect(ds)) == local
    assert outside.read_bytes() == before
    fetched = http.served.bytes_by_path[f"/{original.name}"]
    assert fetched >= original.stat().st_size, "the linked copy is fetched again"
    assert not entry.is_symlink() and entry.is_file()
    assert_copies_of(cache, dataset)


def test_a_cache_dir_shardstream_makes_is_private(http, dataset, local, tmp_path):
    cache = tmp_path / "made" / "cache"
    old_umask = os.umask(0o022)
    try:
        ds = StreamingDataset(http_spec(http, dataset), cache_dir=str(cache))
        assert digests(collect(ds)) == local
    finally:
        os.umask(old_umask)
    for made in (cache, cache.parent):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made
    files = cached_files(cache)
    assert len(files) == len(dataset.paths)
    for file in files:
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file


@pytest.mark.parametrize("how", ["writable-by-others", "another-users"])
def test_an_existing_cache_dir_others_may_write_in_is_refused(http, dataset, tmp_path, how):
    """Another user who may write in ``cache_dir`` could plant a copy (its
    trailer computed from public facts) that would be served as the shard."""
    cache = tmp_path / "shared"
    cache.mkdir()
    if how == "writable-by-others":
        cache.chmod(0o777)
        words = "may be written by other users"
    else:
        if os.geteuid() != 0:
            pytest.fail("giving a directory to another user needs root, as tests run in CI")
        os.chown(cache, 65534, 65534)
        words = "belongs to another user"
    with pytest.raises(ValueError, match=f"cache_dir: .*{words}"):
        StreamingDataset(http_spec(http, dataset), cache_dir=str(cache))
    assert list(cache.iterdir()) == []


# A cached copy is tied to its object's identity (size and ETag, else
# Last-Modified), which each process checks once per shard: an object
# replaced at the same URL (a key named outright, which the plan resolves
# without a request) is read anew, never served from the cache.

# (before, after): of the same size (the tar too), and of another size.
VERSIONS = {
    "same-size": (b"version-1", b"version-2"),
    "other-size": (b"version-1", b"version-2 " * 1000),
}


def read_in_new_process(spec: str, cache: Path, endpoint: str = "") -> dict[str, str]:
    """Each sample's ``txt`` as a new process reads ``spec`` with ``cache``."""
    return in_new_process(read_texts, spec, str(cache), endpoint)


def tar_of(text: bytes) -> bytes:
    """A shard of two samples whose ``txt`` field is ``text``."""
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key in ("0000", "0001"):
            info = tarfile.TarInfo(f"{key}.txt")
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text))
    return buffer.getvalue()


def samples_of(text: bytes) -> dict[str, str]:
    return {"0000": text.decode(), "0001": text.decode()}


@pytest.mark.usefixtures("s3_credentials", "s3_dataset")
@pytest.mark.parametrize("change", sorted(VERSIONS))
def test_an_s3_object_replaced_at_its_key_is_never_served_from_the_cache(s3, tmp_path, change):
    before, after = VERSIONS[change]
    assert (len(tar_of(before)) == len(tar_of(after))) == (change == "same-size")
    key = f"replaced/{change}/a.tar"
    spec = f"s3://{BUCKET}/{key}"
    cache = tmp_path / "cache"
    client = s3.client()
    client.put_object(Bucket=BUCKET, Key=key, Body=tar_of(before))
    assert read_in_new_process(spec, cache, s3.endpoint_url) == samples_of(before)
    assert len(cached_files(cache)) == 1
    client.put_object(Bucket=BUCKET, Key=key, Body=tar_of(after))
    assert read_in_new_process(spec, cache, s3.endpoint_url) == samples_of(after)
    # The new version replaced the old copy, and is served from the cache.
    assert [copied_bytes(f) for f in cached_files(cache)] == [tar_of(after)]
    assert read_in_new_process(spec, cache, s3.endpoint_url) == samples_of(after)


@pytest.mark.parametrize("change", sorted(VERSIONS))
def test_an_http_resource_replaced_at_its_url_is_never_served_from_the_cache(tmp_path, change):
    before, after = VERSIONS[change]
    root = tmp_path / "served"
    root.mkdir()
    shard = root / "a.tar"
    shard.write_bytes(tar_of(before))
    cache = tmp_path / "cache"
    with running_http_server(root) as server:
        spec = server.url("a.tar")
        assert read_in_new_process(spec, cache) == samples_of(before)
        assert len(cached_files(cache)) == 1
        shard.write_bytes(tar_of(after))
        server.reset()
        assert read_in_new_process(spec, cache) == samples_of(after)
        assert body_gets(server) >= 1
        server.reset()
        assert read_in_new_process(spec, cache) == samples_of(after)
        assert (body_gets(server), identity_gets(server)) == (0, 1), "served from the cache"


def test_a_resource_dated_only_is_cached_under_its_date(tmp_path):
    """Without an ETag, Last-Modified (and the size) is the identity."""
    from http_server import Faults

    before, after = VERSIONS["same-size"]
    root = tmp_path / "served"
    root.mkdir()
    shard = root / "a.tar"
    shard.write_bytes(tar_of(before))
    os.utime(shard, (1_700_000_000, 1_700_000_000))
    cache = tmp_path / "cache"
    with running_http_server(root) as server:
        server.reset(Faults(no_etag=True))
        spec = server.url("a.tar")
        assert read_in_new_process(spec, cache) == samples_of(before)
        assert len(cached_files(cache)) == 1
        shard.write_bytes(tar_of(after))
        os.utime(shard, (1_700_000_100, 1_700_000_100))
        assert read_in_new_process(spec, cache) == samples_of(after)


def test_a_resource_without_any_validator_is_not_cached(tmp_path):
    from http_server import Faults

    before, after = VERSIONS["same-size"]
    root = tmp_path / "served"
    root.mkdir()
    shard = root / "a.tar"
    shard.write_bytes(tar_of(before))
    cache = tmp_path / "cache"
    with running_http_server(root) as server:
        server.reset(Faults(no_validator=True))
        spec = server.url("a.tar")
        assert read_in_new_process(spec, cache) == samples_of(before)
        assert cached_files(cache) == []
        assert not list(cache.glob(".tmp-*"))
        shard.write_bytes(tar_of(after))
        assert read_in_new_process(spec, cache) == samples_of(after)
        assert cached_files(cache) == []


def test_stats_count_cache_hits_and_bytes_apart_from_storage_bytes(http, dataset, local, tmp_path):
    cache = tmp_path / "cache"
    shard_bytes = sum(p.stat().st_size for p in dataset.paths)
    # Two epochs exactly: no third started early once the second ends.
    ds = StreamingDataset(
        http_spec(http, dataset), cache_dir=str(cache), read_next_epoch_early=False
    )
    assert digests(collect(ds)) == local
    first = ds.stats()
    assert first["bytes_read"] == shard_bytes
    assert (first["cache_hits"], first["cache_bytes"]) == (0, 0)
    assert digests(collect(ds)) == local
    second = ds.stats()
    assert second["bytes_read"] == shard_bytes, "a cache hit reads no storage byte"
    assert second["cache_hits"] == len(dataset.paths)
    assert second["cache_bytes"] == shard_bytes
    assert second["shards_opened"] == 2 * len(dataset.paths)


@pytest.mark.usefixtures("s3_credentials")
def test_an_s3_object_replaced_between_two_datasets_of_one_process_is_read_anew(s3, tmp_path):
    """A long-lived process (a notebook, a service) makes a second dataset
    over an object replaced since the first read it: the second dataset
    checks the object's identity again and reads the new samples, never the
    old cached copy."""
    client = s3.client()
    client.create_bucket(Bucket=BUCKET)
    spec = f"s3://{BUCKET}/replaced-in-process/a.tar"
    key = spec.removeprefix(f"s3://{BUCKET}/")
    cache = tmp_path / "cache"

    def read() -> dict[str, str]:
        ds = StreamingDataset(spec, s3=config(s3), cache_dir=str(cache), shuffle_buffer=0)
        return {s["__key__"]: s["txt"].decode() for s in collect(ds)}

    before, after = VERSIONS["same-size"]
    client.put_object(Bucket=BUCKET, Key=key, Body=tar_of(before))
    assert read() == samples_of(before)
    assert len(cached_files(cache)) == 1
    client.put_object(Bucket=BUCKET, Key=key, Body=tar_of(after))
    assert read() == samples_of(after)
    assert [copied_bytes(f) for f in cached_files(cache)] == [tar_of(after)]


@pytest.mark.usefixtures("s3_credentials")
def test_shards_read_by_sample_ranges_are_cached_for_every_rank(s3, s3_dataset, tmp_path):
    """With sample counts and two ranks (the DDP set-up) every read is a
    byte range of samples: the shards are still cached as they stream, so
    that the second epoch of both ranks reads no byte from S3."""
    cache = tmp_path / "cache"
    spec = f"s3://{BUCKET}/audio/"
    expected = {key: digest for key, (_, digest) in s3_dataset["expected"].items()}
    ranks = [
        StreamingDataset(
            spec,
            s3=config(s3),
            cache_dir=str(cache),
            count_samples=True,
            world_size=2,
            rank=rank,
            shuffle_buffer=4,
        )
        for rank in range(2)
    ]
    for epoch in range(2):
        got = [s for ds in ranks for s in collect(ds)]
        keys = [s["__key__"] for s in got]
        assert len(keys) == len(set(keys)), f"epoch {epoch}: a sample came twice"
        assert digests(got) == {k: expected[k] for k in keys}
        if epoch == 0:
            first = [ds.stats() for ds in ranks]
            assert len(cached_files(cache)) == len(s3_dataset["urls"])
    second = [ds.stats() for ds in ranks]
    for before, after in zip(first, second, strict=True):
        assert after["cache_hits"] > before["cache_hits"]
        assert after["bytes_read"] == before["bytes_read"], "the second epoch read from S3"

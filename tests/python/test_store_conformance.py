"""One conformance suite that every store passes: local files, S3 (moto's
server), HTTP(S) (tests/python/http_server.py), GCS (the JSON API server of
tests/python/gcs_server.py) and the Hugging Face Hub (tests/python/fake_hub.py
with its CDN), each read directly and each through ``cache_dir``.

Every remote store is reached through the fault proxy of
tests/python/fault_proxy.py, which counts the body bytes it forwards and
cuts bodies, replaces objects mid-read, ignores Range, shortens answers,
answers error statuses or gzips bodies on demand. A store added later joins
by adding a class below and its name to ``STORES``: it then gets every
contract here.

The contracts (DESIGN.md, "Source"):
- whole objects, byte-identical, every sample once at 2 ranks x 2 workers,
  read amplification at most 1.02;
- a body cut mid-way is resumed; an object replaced mid-read is an
  ``ObjectChangedError`` with no sample of the new version handed out;
- 404 is ``ShardNotFoundError``, 401/403 ``StorageAuthError``, 416 a
  ``ShardReadError``, each naming the URL; a server that ignores Range and a
  short answer give the same bytes; a non-identity ``Content-Encoding`` is a
  ``ShardReadError`` naming the coding;
- a replaced object is never served from the cache; a corrupted, truncated
  or symlinked cache entry is fetched again; a symlink planted in the cache
  never redirects a write;
- secrets (keys, tokens, ``http_headers``) appear in no repr, error,
  warning or state.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from _shardtest import (
    assert_exactly_once,
    collect,
    in_new_process,
    loader,
    read_digests,
    read_tar_samples,
    sample_digest,
    uneven_members,
    write_tar,
)
from fake_hub import COMMIT, running_fake_hub
from fault_proxy import FaultProxy, Faults, running_fault_proxy
from gcs_server import running_gcs_api
from http_server import running_http_server
from s3_server import TEST_KEY_ID, TEST_SECRET

import shardstream
from shardstream import StreamingDataset

pytestmark = pytest.mark.timeout(180)

STORES = ["local", "s3", "http", "gcs", "hub"]
REMOTE = [s for s in STORES if s != "local"]
COUNTS = (6, 11, 3, 10)
BUCKET = "conformance"
HUB_REPO = "org/conformance"
HTTP_SECRET = "Bearer c0nf0rmance-s3cr3t"


# --------------------------------------------------------------------------
# The stores
# --------------------------------------------------------------------------


class Store:
    """One store under test: where objects are put and how they are read."""

    name = ""
    proxy: FaultProxy | None = None

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def put(self, name: str, data: bytes) -> None:
        """Creates or replaces object ``name`` (a new version, new validator)."""
        raise NotImplementedError

    def url(self, name: str) -> str:
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        """What a dataset over this store needs besides the URLs."""
        return {}

    def secrets(self) -> list[str]:
        """Secrets this store's reads carry, which must never be shown."""
        return []

    def served_bytes(self) -> int:
        assert self.proxy is not None
        return self.proxy.injected.body_bytes


class LocalStore(Store):
    name = "local"

    def __init__(self, prefix: str, root: Path) -> None:
        super().__init__(prefix)
        self.root = root / prefix
        self.root.mkdir(parents=True)

    def put(self, name: str, data: bytes) -> None:
        staged = self.root / f".{name}.new"
        staged.write_bytes(data)
        os.replace(staged, self.root / name)

    def url(self, name: str) -> str:
        return str(self.root / name)


class S3Store(Store):
    name = "s3"

    def __init__(self, prefix: str, client: Any, proxy: FaultProxy) -> None:
        super().__init__(prefix)
        self.client, self.proxy = client, proxy

    def put(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=BUCKET, Key=f"{self.prefix}/{name}", Body=data)

    def url(self, name: str) -> str:
        return f"s3://{BUCKET}/{self.prefix}/{name}"

    def options(self) -> dict[str, Any]:
        endpoint = self.proxy.endpoint_url  # type: ignore[union-attr]
        return {"s3": {"endpoint_url": endpoint, "region": "us-east-1", "path_style": True}}

    def secrets(self) -> list[str]:
        return [TEST_SECRET]


class HttpStore(Store):
    name = "http"

    def __init__(self, prefix: str, root: Path, proxy: FaultProxy) -> None:
        super().__init__(prefix)
        self.root, self.proxy = root / prefix, proxy
        self.root.mkdir(parents=True)

    def put(self, name: str, data: bytes) -> None:
        path = self.root / name
        fresh = not path.exists()
        staged = self.root / f".{name}.new"
        staged.write_bytes(data)
        os.replace(staged, path)
        if not fresh:
            # A new Last-Modified too, whatever the clock's resolution.
            stamp = path.stat().st_mtime + 10
            os.utime(path, (stamp, stamp))

    def url(self, name: str) -> str:
        return f"{self.proxy.endpoint_url}/{self.prefix}/{name}"  # type: ignore[union-attr]

    def options(self) -> dict[str, Any]:
        return {"http_headers": {"Authorization": HTTP_SECRET}}

    def secrets(self) -> list[str]:
        return [HTTP_SECRET, HTTP_SECRET.split()[1]]


class GcsStore(Store):
    name = "gcs"

    def __init__(self, prefix: str, api: Any, proxy: FaultProxy):
        super().__init__(prefix)
        self.objects, self.proxy, self.token = api.objects[BUCKET], proxy, api.token

    def secrets(self) -> list[str]:
        return [self.token]

    def put(self, name: str, data: bytes) -> None:
        key = f"{self.prefix}/{name}"
        generation = self.objects.get(key, (b"", 1000))[1] + 1
        self.objects[key] = (data, generation)

    def url(self, name: str) -> str:
        return f"gs://{BUCKET}/{self.prefix}/{name}"


class HubStore(Store):
    name = "hub"

    def __init__(self, prefix: str, root: Path, proxy: FaultProxy) -> None:
        super().__init__(prefix)
        self.root, self.proxy = root / HUB_REPO / prefix, proxy
        self.root.mkdir(parents=True)

    def put(self, name: str, data: bytes) -> None:
        staged = self.root / f".{name}.new"
        staged.write_bytes(data)
        os.replace(staged, self.root / name)

    def url(self, name: str) -> str:
        return f"hf://datasets/{HUB_REPO}@{COMMIT}/{self.prefix}/{name}"

    def secrets(self) -> list[str]:
        return [os.environ["HF_TOKEN"]]


@pytest.fixture(scope="module")
def servers(s3, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """Every remote store's server, each behind a fault proxy of its own."""
    with ExitStack() as stack:
        enter = stack.enter_context
        client = s3.client()
        client.create_bucket(Bucket=BUCKET)
        http_root = tmp_path_factory.mktemp("http-store")
        http = enter(running_http_server(http_root))
        hub_root = tmp_path_factory.mktemp("hub-store")
        cdn = enter(running_http_server(hub_root))
        gcs = enter(running_gcs_api({BUCKET: {}}))
        # Every request must carry the metadata server's token.
        gcs.required = True
        proxies = {
            "s3": enter(running_fault_proxy(s3.endpoint_url)),
            "http": enter(running_fault_proxy(http.base_url)),
            "gcs": enter(running_fault_proxy(gcs.endpoint)),
            "hub": enter(running_fault_proxy(cdn.base_url)),
        }
        hub = enter(running_fake_hub(hub_root, proxies["hub"].endpoint_url))
        yield {
            "http": http,
            "elsewhere": enter(running_http_server(http_root)),
            "s3_client": client,
            "http_root": http_root,
            "hub_root": hub_root,
            "hub": hub,
            "gcs": gcs,
            "proxies": proxies,
        }


@pytest.fixture
def environment(monkeypatch, tmp_path) -> None:
    """Each store's credentials and endpoints, as a user would set them
    (subprocesses inherit them)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", TEST_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.delenv("GCE_METADATA_HOST", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))


def make_store(kind: str, servers: dict[str, Any], tmp_path: Path, monkeypatch) -> Store:
    prefix = hashlib.sha1(str(tmp_path).encode()).hexdigest()[:12]
    if kind == "local":
        return LocalStore(prefix, tmp_path / "local-store")
    proxy = servers["proxies"][kind]
    proxy.reset()
    if kind == "s3":
        return S3Store(prefix, servers["s3_client"], proxy)
    if kind == "http":
        return HttpStore(prefix, servers["http_root"], proxy)
    if kind == "gcs":
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint_url)
        monkeypatch.setenv("GCE_METADATA_HOST", servers["gcs"].endpoint.removeprefix("http://"))
        return GcsStore(prefix, servers["gcs"], proxy)
    monkeypatch.setenv("HF_ENDPOINT", servers["hub"].base_url)
    monkeypatch.setenv("HF_TOKEN", servers["hub"].token)
    return HubStore(prefix, servers["hub_root"], proxy)


@pytest.fixture(params=STORES)
def store(request, servers, environment, tmp_path, monkeypatch) -> Store:
    return make_store(request.param, servers, tmp_path, monkeypatch)


@pytest.fixture(params=REMOTE)
def remote(request, servers, environment, tmp_path, monkeypatch) -> Store:
    return make_store(request.param, servers, tmp_path, monkeypatch)


# --------------------------------------------------------------------------
# The data
# --------------------------------------------------------------------------


class Shards:
    """Four uneven shards put into a store, and what they hold."""

    def __init__(self, store: Store, root: Path, counts=COUNTS, seed: int = 0) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.names = [f"shard-{i:06d}.tar" for i in range(len(counts))]
        self.data: dict[str, bytes] = {}
        self.expected: dict[str, dict[str, str]] = {}
        for i, (name, count) in enumerate(zip(self.names, counts, strict=True)):
            path = write_tar(root / name, uneven_members(i, count, seed))
            self.data[name] = path.read_bytes()
            for sample in read_tar_samples(path):
                self.expected[sample.key] = sample.digest()
            store.put(name, self.data[name])
        self.urls = [store.url(n) for n in self.names]
        self.total_bytes = sum(len(d) for d in self.data.values())


def check_samples(samples: list[dict[str, Any]], shards: Shards) -> None:
    """Every sample once, each byte-identical to the shard's own."""
    assert_exactly_once([s["__key__"] for s in samples], shards.expected)
    for s in samples:
        assert sample_digest(s) == shards.expected[s["__key__"]], s["__key__"]


def flipped(data: bytes) -> bytes:
    """``data`` with every byte of each member's body changed (headers kept,
    so the tar stays valid and every sample reads, with new bytes)."""
    import io
    import tarfile

    out = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(data)) as src,
        tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as dst,
    ):
        for member in src:
            body = src.extractfile(member).read() if member.isfile() else b""  # type: ignore[union-attr]
            dst.addfile(member, io.BytesIO(bytes(b ^ 0xFF for b in body)))
    new = out.getvalue()
    assert len(new) == len(data) and new != data
    return new


def dataset(store: Store, shards: Shards, **options: Any) -> StreamingDataset:
    return StreamingDataset(
        shards.urls, shuffle_buffer=0, shuffle_shards=False, **store.options(), **options
    )


# --------------------------------------------------------------------------
# Delivery
# --------------------------------------------------------------------------


@pytest.mark.parametrize("cached", [False, True], ids=["direct", "cached"])
def test_every_sample_once_at_two_ranks_of_two_workers(store, tmp_path, cached):
    shards = Shards(store, tmp_path / "src")
    manifest = tmp_path / "manifest.json"
    proc = subprocess.run(
        [sys.executable, "-m", "shardstream", "index", *shards.urls, "-o", str(manifest)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "AWS_ENDPOINT_URL": getattr(store.proxy, "endpoint_url", "")},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    if store.proxy is not None:
        store.proxy.reset()
    options: dict[str, Any] = {"manifest": str(manifest)}
    if cached:
        options["cache_dir"] = str(tmp_path / "cache")
    samples = []
    for rank in (0, 1):
        ds = dataset(store, shards, world_size=2, rank=rank, **options)
        got = collect(loader(ds, 2))
        assert len(got) == sum(COUNTS) // 2
        samples += got
    check_samples(samples, shards)
    if store.proxy is not None:
        amplification = store.served_bytes() / shards.total_bytes
        assert amplification <= 1.02, amplification


@pytest.mark.parametrize("cached", [False, True], ids=["direct", "cached"])
def test_a_cut_body_is_resumed_and_a_range_ignored_or_shortened_gives_the_same_bytes(
    remote, tmp_path, cached
):
    shards = Shards(remote, tmp_path / "src")
    options = {"cache_dir": str(tmp_path / "cache")} if cached else {}
    assert remote.proxy is not None
    for faults in (
        Faults(cut_bodies=2, cut_after=3000),
        Faults(whole_on_range=100),
        Faults(short_on_range=3),
    ):
        remote.proxy.reset(faults)
        check_samples(collect(dataset(remote, shards, **options)), shards)
        if options:
            shutil.rmtree(options["cache_dir"], ignore_errors=True)
    # (A GCS object's metadata answers are too short to cut.)
    remote.proxy.reset(Faults(cut_bodies=1, cut_after=3000))
    ds = dataset(remote, shards, **options)
    check_samples(collect(ds), shards)
    assert ds.stats()["resumed_bodies"] >= 1


def read_while_replaced(store: Store, root: Path, error: type[Exception]) -> Shards:
    """Reads one shard of 40 samples whose first long body is cut while the
    object is replaced by another version of the same size: ``error`` is
    raised naming it, and only samples of the first version came out."""
    shards = Shards(store, root, counts=(40,))
    name = shards.names[0]
    new = flipped(shards.data[name])
    assert store.proxy is not None
    store.proxy.reset(Faults(cut_bodies=1, cut_after=20_000, on_cut=lambda _: store.put(name, new)))
    got: list[dict[str, Any]] = []
    with pytest.raises(error) as raised:
        for sample in dataset(store, shards):
            got.append(sample)
    assert name in str(raised.value)
    for s in got:
        assert sample_digest(s) == shards.expected[s["__key__"]], s["__key__"]
    return shards


def test_an_object_replaced_mid_read_is_object_changed_error(remote, tmp_path):
    read_while_replaced(remote, tmp_path / "src", shardstream.ObjectChangedError)


# --------------------------------------------------------------------------
# What servers answer
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (404, shardstream.ShardNotFoundError),
        (403, shardstream.StorageAuthError),
        (401, shardstream.StorageAuthError),
        (416, shardstream.ShardReadError),
    ],
)
def test_error_statuses_are_specific_errors_naming_the_url(remote, tmp_path, status, error):
    shards = Shards(remote, tmp_path / "src", counts=(4,))
    assert remote.proxy is not None
    remote.proxy.reset(Faults(status_first=1000, status=status))
    with pytest.raises(error) as raised:
        collect(dataset(remote, shards))
    message = str(raised.value)
    assert shards.names[0] in message or remote.prefix in message, message
    for secret in remote.secrets():
        assert secret not in message


GZIP_STORES = [s for s in REMOTE if s != "s3"]


@pytest.mark.parametrize("kind", GZIP_STORES)
def test_a_gzip_coded_answer_is_a_read_error_naming_the_coding(
    kind, servers, environment, tmp_path, monkeypatch
):
    store = make_store(kind, servers, tmp_path, monkeypatch)
    shards = Shards(store, tmp_path / "src", counts=(4,))
    assert store.proxy is not None
    store.proxy.reset(Faults(gzip=True))
    with pytest.raises(shardstream.ShardReadError, match="gzip") as raised:
        collect(dataset(store, shards))
    assert shards.names[0] in str(raised.value)


def test_s3_content_encoding_is_metadata_and_the_stored_bytes_are_read(
    servers, environment, tmp_path, monkeypatch
):
    """S3 serves an object's bytes as stored: a ``Content-Encoding`` set at
    upload is metadata, not a transformation, so the bytes read are the
    object's own (here the tar itself, uploaded with ``gzip`` metadata)."""
    store = make_store("s3", servers, tmp_path, monkeypatch)
    assert isinstance(store, S3Store)
    shards = Shards(store, tmp_path / "src", counts=(5,))
    store.client.put_object(
        Bucket=BUCKET,
        Key=f"{store.prefix}/{shards.names[0]}",
        Body=shards.data[shards.names[0]],
        ContentEncoding="gzip",
    )
    check_samples(collect(dataset(store, shards)), shards)


def test_a_resource_without_a_validator_is_one_get_and_never_spliced(
    servers, environment, tmp_path, monkeypatch
):
    """A server that sends neither ETag nor Last-Modified gives nothing to
    pin parts or a resume to: the shard is one GET, and a body cut short
    (here while the resource is replaced) is a ``ShardReadError``."""
    from http_server import Faults as ServerFaults

    store = make_store("http", servers, tmp_path, monkeypatch)
    http = servers["http"]
    http.reset(ServerFaults(no_validator=True))
    try:
        shards = read_while_replaced(store, tmp_path / "src", shardstream.ShardReadError)
        name = shards.names[0]
        assert store.proxy is not None
        store.proxy.reset()
        http.reset(ServerFaults(no_validator=True))
        again = collect(dataset(store, shards))
        assert len(again) == 40
        assert all(sample_digest(s) != shards.expected[s["__key__"]] for s in again)
        # One GET of the whole resource (and at most a HEAD), no ranges.
        assert http.served.gets_by_path[f"/{store.prefix}/{name}"] <= 2
        assert all("range" not in h for h in http.served.headers), http.served.headers
    finally:
        http.reset()


def test_a_redirect_to_another_origin_takes_no_headers_along(
    servers, environment, tmp_path, monkeypatch
):
    """``http_headers`` go to the shard's own origin only: a redirect to
    another host (a CDN) is followed without them."""
    store = make_store("http", servers, tmp_path, monkeypatch)
    shards = Shards(store, tmp_path / "src", counts=(5, 3))
    http, elsewhere = servers["http"], servers["elsewhere"]
    elsewhere.reset()
    http.redirect_to = elsewhere.base_url
    try:
        check_samples(collect(dataset(store, shards)), shards)
    finally:
        http.redirect_to = None
    assert elsewhere.served.gets >= len(shards.names)
    for headers in elsewhere.served.headers:
        assert "authorization" not in headers, headers
    for secret in store.secrets():
        assert all(secret not in str(h) for h in elsewhere.served.headers)


# --------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------


def read_in_new_process(store: Store, shards: Shards, cache: Path) -> dict[str, dict[str, str]]:
    """Every sample's digest as a new process reads it with ``cache``."""
    options: dict[str, Any] = {"cache_dir": str(cache)}
    options.update(store.options())
    return in_new_process(read_digests, shards.urls, options)


def cached_files(cache: Path) -> list[Path]:
    """The cached copies (regular files, not hidden)."""
    return sorted(
        p
        for p in cache.rglob("*")
        if p.is_file() and not p.is_symlink() and not p.name.startswith(".")
    )


def test_a_replaced_object_is_never_served_from_the_cache(remote, tmp_path):
    shards = Shards(remote, tmp_path / "src")
    cache = tmp_path / "cache"
    assert read_in_new_process(remote, shards, cache) == shards.expected
    assert cached_files(cache), "nothing was cached"
    for name in shards.names:
        remote.put(name, flipped(shards.data[name]))
    fresh = Shards.__new__(Shards)
    fresh.urls = shards.urls
    got = read_in_new_process(remote, fresh, cache)
    assert got.keys() == shards.expected.keys()
    assert all(got[k] != shards.expected[k] for k in got), "a cached old version was served"


@pytest.mark.parametrize("damage", ["corrupted", "truncated", "symlinked"])
def test_a_damaged_cache_entry_is_fetched_again(remote, tmp_path, damage):
    shards = Shards(remote, tmp_path / "src")
    cache = tmp_path / "cache"
    assert read_in_new_process(remote, shards, cache) == shards.expected
    entries = cached_files(cache)
    assert len(entries) == len(shards.names), entries
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not yours" * 1000)
    for entry in entries:
        if damage == "corrupted":
            data = bytearray(entry.read_bytes())
            data[len(data) // 2] ^= 0xFF
            entry.write_bytes(bytes(data))
        elif damage == "truncated":
            with open(entry, "r+b") as f:
                f.truncate(entry.stat().st_size // 2)
        else:
            entry.unlink()
            entry.symlink_to(outside)
    assert read_in_new_process(remote, shards, cache) == shards.expected
    assert outside.read_bytes() == b"not yours" * 1000


def test_a_symlink_planted_in_the_cache_never_redirects_a_write(remote, tmp_path):
    """Every name the cache writes (its lock, its probe, a copy being
    filled) may be a planted link: the file it points to stays as it was."""
    shards = Shards(remote, tmp_path / "src")
    cache = tmp_path / "cache"
    assert read_in_new_process(remote, shards, cache) == shards.expected
    names = {p.name for p in cache.rglob("*")}
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    shutil.rmtree(cache)
    cache.mkdir()
    for name in names | {".evict.lock"}:
        (cache / name).symlink_to(victim)
    assert read_in_new_process(remote, shards, cache) == shards.expected
    assert victim.read_text() == "precious"


# --------------------------------------------------------------------------
# Secrets
# --------------------------------------------------------------------------


def test_secrets_appear_in_no_repr_error_warning_or_state(remote, tmp_path):
    shards = Shards(remote, tmp_path / "src", counts=(5, 4))
    secrets = remote.secrets()
    ds = dataset(remote, shards)
    it = iter(ds)
    next(it)
    shown = [repr(ds), repr(ds.options), json.dumps(ds.state_dict(), default=str)]
    del it
    assert remote.proxy is not None
    remote.proxy.reset(Faults(status_first=1000, status=404))
    errors: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for on_error in ("raise", "warn"):
            try:
                collect(dataset(remote, shards, on_error=on_error))
            except shardstream.ShardStreamError as e:
                errors += [str(e), repr(e)]
    assert errors, "a 404 raised nothing"
    shown += errors + [str(w.message) for w in caught]
    assert secrets
    for secret in secrets:
        for text in shown:
            assert secret not in text

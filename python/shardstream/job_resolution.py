"""One resolution per job: under ``torch.distributed``, rank 0 resolves a
dataset (listings, HEADs, Parquet footers, the manifest, sample counts) and
every other rank receives the resolved shard list (its compact form)
through the process group's store, instead of listing the bucket itself.
Before the process group exists, the processes torchrun started on one node
share one resolution through a file of the node (``_node_share``).

Nothing here is a collective: rank 0 never waits, and a rank that finds no
resolution from rank 0 (rank 0 made no such dataset, or made it much later)
resolves by itself after a bounded wait, with a warning, so that a dataset
made on some ranks only can never hang a job. A resolution error on rank 0
reaches every rank as the same exception.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import re
import stat
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from . import _core
from ._core import ShardList, ShardStreamError, _rebuild_shard_list

__all__ = ["resolve_once"]

# How long a rank waits for rank 0 to say it started resolving the same
# dataset, and then for its result: the listing of a million keys takes
# minutes, a rank 0 that made no such dataset never starts.
START_WAIT = timedelta(seconds=60)
RESULT_WAIT = timedelta(minutes=30)
# The store is polled in slices of this, so that a lost rank 0 shows.
POLL = timedelta(seconds=5)
# Shards each process reads at once when ``count_samples=True`` indexes
# remote shards at start-up.
COUNT_JOBS = 8
# The default store server (libuv's, torchrun's agent's too) drops a client
# that sends a value over 8 MiB: a resolution goes in parts of this size.
PART_BYTES = 4 << 20

_made: Counter[str] = Counter()


def _default_store() -> Any | None:
    """The default process group's key-value store, if it can be had."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _key(specs: Sequence[str], options: Any) -> str:
    """The store key of this process's n-th dataset of these specs and
    options (anything that decides the resolution may be given with
    them): ranks that make the same datasets in the same order agree."""
    # Without the addresses a repr may show (a transform's), which differ
    # between processes.
    shown = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(options))
    digest = hashlib.sha256(repr((list(specs), shown)).encode()).hexdigest()[:32]
    _made[digest] += 1
    return f"shardstream/resolution/{digest}/{_made[digest]}"


def _wait(store: Any, key: str, limit: timedelta) -> bool:
    """Whether ``key`` appeared in ``store`` within ``limit``."""
    deadline = time.monotonic() + limit.total_seconds()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            store.wait([key], timedelta(seconds=min(left, POLL.total_seconds())))
            return True
        except RuntimeError as e:  # a timeout (DistStoreError is one)
            if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                raise


def resolve_once(
    specs: Sequence[str], options: Any, resolve: Callable[[], ShardList], counted: bool
) -> ShardList:
    """``resolve()`` on rank 0 of an initialised process group, its result
    (or its error) handed to the other ranks; ``resolve()`` everywhere when
    there is no process group of several ranks. ``counted`` says whether
    ``resolve()`` counts samples (a job of several ranks): part of the key."""
    if not (dist.is_available() and dist.is_initialized()):
        # Every path calls resolve() from this frame: the warnings it gives
        # point at the line that made the dataset.
        with _node_share(specs, options, counted) as share:
            if share.found is not None:
                return share.found
            shard_list = resolve()
            _count_remote(shard_list)
            share.keep(shard_list)
            return shard_list
    if dist.get_world_size() < 2:
        return _count_remote(resolve())
    store = _default_store()
    if store is None:
        return _count_remote(resolve())
    key = _key(specs, (options, counted))
    if dist.get_rank() == 0:
        store.set(f"{key}/started", b"1")
        try:
            shard_list = resolve()
        except BaseException as error:
            # Whatever it is (a panic, Ctrl-C), the other ranks hear of it
            # at once rather than after RESULT_WAIT.
            _publish(store, key, _encoded_error(error))
            raise
        _publish(store, key, _encoded(shard_list))
    elif _wait(store, f"{key}/started", START_WAIT) and _wait(store, key, RESULT_WAIT):
        shard_list = _decoded(_fetch(store, key), options)
        # This node's copies of local shards are read by the spans of rank
        # 0's: one that is missing or differs is an error here, not mid-epoch.
        shard_list.check_local_files()
        # Rank 0 spreads the counting (if any) over the ranks that say so.
        store.set(f"{key}/joined/{dist.get_rank()}", b"1")
    else:
        warnings.warn(
            "shardstream: rank 0 did not resolve this dataset (is it made on every rank, "
            "in the same order?); this rank resolves it by itself",
            RuntimeWarning,
            stacklevel=3,
        )
        return _count_remote(resolve())
    return _count_remote(shard_list, store, key)


def _count_remote(shard_list: ShardList, store: Any = None, key: str = "") -> ShardList:
    """``count_samples=True`` on remote tar shards no manifest describes (nor
    ``cache_dir`` kept counts for): reads them through once at start-up to
    index them, and keeps their counts in ``cache_dir`` for the next start.
    In a process group (``store``), each rank reads every N-th of them and
    hands its part to the others through the store, so the job reads each
    shard once; a rank's part that does not come in time is read by the
    waiting rank itself, with a warning, and a rank's error reaches every
    rank."""
    todo = shard_list.uncounted_remote()
    if not todo:
        return shard_list
    if store is None:
        parts = [shard_list.index_shards(todo, COUNT_JOBS)]
    else:
        parts = _count_spread(shard_list, todo, store, key)
    # Counts are kept for shards whose identity a listing gave (a size and
    # an ETag): shards named outright have neither until their counts,
    # which record what the count read, are attached.
    listed = all(size is not None for size in shard_list.sizes)
    for part in parts:
        shard_list.attach_counts(part)
    if listed:
        packed = [json.loads(part) for part in parts]
        merged = dict(packed[0], shards=[entry for part in packed for entry in part["shards"]])
        shard_list.keep_counts(json.dumps(merged))
    return shard_list


def _count_spread(shard_list: ShardList, todo: list[int], store: Any, key: str) -> list[str]:
    """Every share of the sample counts of the shards at ``todo`` (manifests,
    JSON), read by the ranks that received rank 0's resolution: rank 0 names
    them (those that said so within ``START_WAIT``; it never waits longer
    for a rank that made no such dataset), each reads its share, and the
    shares travel through the store. A share that does not come within
    ``RESULT_WAIT`` of the start is read by the rank that waited for it,
    with a warning; a rank's error reaches the others as the same error."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        readers = [0, *_joined(store, key, world_size)]
        store.set(f"{key}/readers", json.dumps(readers).encode())
    elif _wait(store, f"{key}/readers", START_WAIT + POLL):
        readers = json.loads(store.get(f"{key}/readers"))
    else:
        readers = []
    if rank not in readers:
        # Left out (late): this rank reads every shard itself.
        return [shard_list.index_shards(todo, COUNT_JOBS)]
    shares = {r: todo[i :: len(readers)] for i, r in enumerate(readers)}
    try:
        own = shard_list.index_shards(shares[rank], COUNT_JOBS)
    except BaseException as error:
        _publish(store, f"{key}/counts/{rank}", _encoded_error(error))
        raise
    _publish(store, f"{key}/counts/{rank}", own.encode())
    parts = [own]
    deadline = time.monotonic() + RESULT_WAIT.total_seconds()
    for other in readers:
        if other == rank:
            continue
        name = f"{key}/counts/{other}"
        left = timedelta(seconds=max(0.0, deadline - time.monotonic()))
        if _wait(store, name, left):
            text = _fetch(store, name).decode()
            _raise_if_error(json.loads(text))
        else:
            warnings.warn(
                f"shardstream: rank {other} did not hand over the sample counts of its share "
                "of the shards; this rank reads them itself",
                RuntimeWarning,
                stacklevel=5,
            )
            text = shard_list.index_shards(shares[other], COUNT_JOBS)
        parts.append(text)
    return parts


def _joined(store: Any, key: str, world_size: int) -> list[int]:
    """The ranks (but 0) that said, within ``START_WAIT``, that they
    received this resolution."""
    names = [f"{key}/joined/{r}" for r in range(1, world_size)]
    deadline = time.monotonic() + START_WAIT.total_seconds()
    while not store.check(names) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [r for r, name in zip(range(1, world_size), names, strict=True) if store.check([name])]


def _publish(store: Any, key: str, data: bytes) -> None:
    """Sets ``data`` under ``key`` in parts of at most ``PART_BYTES``
    (``key/part/i``), then ``key`` itself, which says how many: the other
    ranks wait for ``key``, so every part is there when they see it."""
    parts = [data[i : i + PART_BYTES] for i in range(0, len(data), PART_BYTES)]
    for index, part in enumerate(parts):
        store.set(f"{key}/part/{index}", part)
    store.set(key, json.dumps({"parts": len(parts)}).encode())


def _fetch(store: Any, key: str) -> bytes:
    """What ``_publish`` set under ``key``, its parts joined."""
    parts = json.loads(store.get(key))["parts"]
    return b"".join(store.get(f"{key}/part/{index}") for index in range(parts))


def _encoded(shard_list: ShardList) -> bytes:
    """What rebuilds ``shard_list`` (its specs, manifest, counts and the
    compact form of its shards), as JSON data (never a pickle: nothing
    read back can run code), less its options, which every process has
    (and which may hold a transform that does not pickle)."""
    _, (specs, _options, manifest, counted, shards) = shard_list.__reduce__()
    packed = {"specs": specs, "manifest": manifest, "counted": counted}
    packed["shards"] = base64.b64encode(shards).decode()
    return json.dumps(packed).encode()


def _encoded_error(error: BaseException) -> bytes:
    """``error`` for the other ranks: its class's name and its message."""
    return json.dumps({"error": type(error).__name__, "message": str(error)}).encode()


def _raise_if_error(packed: dict[str, Any]) -> None:
    """Raises the error ``_encoded_error`` packed, if ``packed`` is one, as
    shardstream's exception of that name (``ValueError``, ``TypeError``,
    else ``ShardStreamError``)."""
    if "error" not in packed:
        return
    name, message = packed["error"], packed["message"]
    cls = getattr(_core, name, None)
    if not (isinstance(cls, type) and issubclass(cls, ShardStreamError)):
        cls = {"ValueError": ValueError, "TypeError": TypeError}.get(name, ShardStreamError)
    raise cls(message)


def _decoded(data: bytes, options: Any) -> ShardList:
    """The shard list ``_encoded`` gave, with this process's ``options``;
    an error ``_encoded_error`` gave is raised as shardstream's exception
    of that name (``ValueError``, ``TypeError``, else ``ShardStreamError``)."""
    packed = json.loads(data)
    _raise_if_error(packed)
    shards = base64.b64decode(packed["shards"])
    return _rebuild_shard_list(
        packed["specs"], options, packed["manifest"], packed["counted"], shards
    )


# How long a node's resolution is reused by the processes of one torchrun
# job that start after it: they make their datasets at about the same time.
NODE_REUSE = timedelta(minutes=10)


class _NodeShare:
    """The resolution shared by torchrun's processes of one node: ``found``
    when an earlier process of the job left it, else ``keep`` leaves it for
    the next ones (see ``_node_share``)."""

    def __init__(self, base: str | None, options: Any) -> None:
        self.base = base
        self.found = None if base is None else _read_fresh(f"{base}.json", options)

    def keep(self, shard_list: ShardList) -> None:
        """Leaves ``shard_list`` for the processes that come next."""
        if self.base is None:
            return
        with contextlib.suppress(OSError):
            staged = f"{self.base}.{os.getpid()}.tmp"
            fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(_encoded(shard_list))
            os.replace(staged, f"{self.base}.json")


@contextlib.contextmanager
def _node_share(specs: Sequence[str], options: Any, counted: bool) -> Iterator[_NodeShare]:
    """For the processes torchrun started on this node (``LOCAL_WORLD_SIZE``
    > 1, one ``TORCHELASTIC_RUN_ID``), one at a time under a lock: the first
    resolves and keeps the result in a file of a directory private to the
    user, the others find it there. Elsewhere, or when that directory is
    not safe to use, nothing is shared."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    lock = None
    base = None
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) > 1 and run:
        with contextlib.suppress(OSError):
            folder = _private_folder()
            if folder is not None:
                # The agent (every local process's parent) and its restart:
                # a job started later, with the same run id ("none" without
                # one), is another agent, and resolves anew.
                job = (run, os.getppid(), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
                name = _key(specs, (job, options, counted)).rsplit("/", 2)
                flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                path = os.path.join(folder, f"{name[-2]}-{name[-1]}")
                lock = os.open(f"{path}.lock", flags, 0o600)
                fcntl.flock(lock, fcntl.LOCK_EX)
                base = path
    try:
        yield _NodeShare(base, options)
    finally:
        if lock is not None:
            os.close(lock)


def _private_folder() -> str | None:
    """``shardstream-<uid>`` in the temporary directory, made 0700; ``None``
    when it is not a directory of this user's that no one else may write
    (a planted link or another user's directory is never used)."""
    folder = os.path.join(tempfile.gettempdir(), f"shardstream-resolution-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    info = os.lstat(folder)
    mode, owner = info.st_mode, info.st_uid
    private = stat.S_ISDIR(mode) and owner == os.getuid() and not mode & 0o077
    return folder if private else None


def _read_fresh(path: str, options: Any) -> ShardList | None:
    """The shard list written at ``path`` within ``NODE_REUSE``, if any
    (and if it reads: a file of another version is passed over)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if time.time() - os.fstat(f.fileno()).st_mtime > NODE_REUSE.total_seconds():
            return None
        try:
            return _decoded(f.read(), options)
        except (ValueError, KeyError, TypeError, ShardStreamError):
            return None

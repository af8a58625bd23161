"""Field bytes of remote, compressed and cached shards that cross from a
DataLoader worker to the main process through shared memory rather than
through the worker's pipe.

In a DataLoader worker, a member of 16 KiB or more that is not handed out by
reference to a local shard (``shardstream.local_bytes``) is a
``SharedBytes``: ``bytes`` in every way, but ``multiprocessing``'s pickler
(``ForkingPickler``, which the DataLoader's worker result queue pickles
batches with) copies it into a shared-memory segment of the worker (a file in
``/dev/shm``, mapped) and pickles its place there (segment, use, offset,
length). The main process maps each segment once, unlinks it at once (its
name is gone from ``/dev/shm`` as soon as it is mapped) and copies each
member out of the mapping into a plain ``bytes``: one copy in each process,
no system call per member, instead of a pickle, a pipe write, a pipe read
and an unpickle of every byte. Plain ``pickle`` (and ``copy``) gives the
bytes themselves.

Reused: a worker fills one segment after another; when the main process
reaches a member of the worker's next segment, it has read every member of
the previous one (a worker's batches arrive in the order it pickled them)
and marks it done (a byte of its header), and the worker fills it again.
Pages are allocated once per segment, not once per member.

Bounded: segments are 4 MiB (a quarter of ``worker_shared_memory_bytes`` if
that is less); a worker makes them as needed up to
``worker_shared_memory_bytes`` in all (64 MiB by default), its space reserved
at creation (``posix_fallocate``: a full ``/dev/shm`` is an error there,
never a ``SIGBUS`` later). A member longer than a segment gets a segment of
its own, unmapped by both processes once read. A member that finds no room
(every segment still being read, or ``/dev/shm`` full) goes through the pipe
as before: nothing waits. The consumer's ``bytes`` are its own copies, so
samples kept after the epoch hold no shared memory.

Crash-safe: a segment's name carries the pid namespace, the main process's
id, the worker's id and a random token
(``shardstream-<namespace>-<main>-<worker>-<token>-<n>``). A worker removes
its segments not yet mapped when it exits (the DataLoader stops reading from
a worker only when it shuts the workers down). The main process checks, twice
a second while it holds segments of workers, which of those workers are
gone, unmaps their segments and removes those still named (a worker killed
mid-epoch); at exit it removes every segment named after it; and the first
time it maps a segment it removes those named after main processes (of its
pid namespace) that are gone. Memory is freed when both processes have
unmapped a segment: when the worker exits and the main process sees it gone.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable
from multiprocessing import util
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

from ._core import ShardReadError
from ._core import raise_malloc_thresholds as _raise_malloc_thresholds

# Where segments are made: a tmpfs on Linux.
SHM_DIR = Path("/dev/shm")
# Every segment's name starts with this.
PREFIX = "shardstream-"


def _pid_namespace() -> str:
    """This process's pid namespace (its inode), so that processes of another
    namespace sharing /dev/shm (containers) are never taken for gone."""
    try:
        return os.readlink("/proc/self/ns/pid").partition("[")[2].rstrip("]") or "0"
    except OSError:
        return "0"


def main_prefix(main: int | None = None) -> str:
    """The start of the names of segments handed to process ``main`` (this
    one by default): ``shardstream-<pid namespace>-<main>-``."""
    return f"{PREFIX}{_NAMESPACE}-{os.getpid() if main is None else main}-"


_NAMESPACE = _pid_namespace()
# Size of a segment (a longer member gets one of its own size).
SEGMENT_BYTES = 4 << 20
# Whether shared memory can be used here (Linux: a /dev/shm and
# posix_fallocate); elsewhere members go through the pipe.
SHARED_MEMORY_AVAILABLE = hasattr(os, "posix_fallocate") and SHM_DIR.is_dir()
# How often the main process looks for workers that are gone, in seconds.
REAP_INTERVAL = 0.5


class SharedBytes(bytes):
    """``bytes`` of a member that ``multiprocessing`` pickles as its place in
    a shared-memory segment of this process, unpickled as a plain ``bytes``
    read from there; plain ``pickle`` gives a plain ``bytes`` of the data."""

    __slots__ = ()

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (bytes, (bytes(self),))


def configure(limit: int, raise_thresholds: bool = False, main: int | None = None) -> None:
    """Sets this process's bound on shared memory (bytes; 0: every member
    goes through the pipe), whether the main process raises its malloc
    thresholds on its first read (see ``local_bytes``), and the main
    process's id (the parent's by default), named in the segments."""
    writer = _writer()
    writer.limit, writer.raise_thresholds = limit, raise_thresholds
    if main is not None and not writer.segments:
        writer.owner = writer.owner_for(main)


def _reduce_shared(value: SharedBytes) -> tuple[Callable[..., bytes], tuple[Any, ...]]:
    """``ForkingPickler``'s reduction of a ``SharedBytes``: written into this
    worker's current segment, pickled as its place there; when the bound or
    the file system leaves no room, pickled as the bytes themselves."""
    place = _writer().write(value)
    if place is None:
        return (bytes, (bytes(value),))
    return (read_shared, place)


ForkingPickler.register(SharedBytes, _reduce_shared)


# Each segment starts with a header: its first byte is set to DONE by the main
# process once it has read every member of that use of the segment; its
# second is ONE_OFF for a segment made for one member longer than the others
# (unmapped by both processes once done, not reused).
HEADER_BYTES = 64
DONE = 1
ONE_OFF = 1


class _Segment:
    """One segment of a worker: its path, its mapping, the number of its
    current use (the worker's count of segment uses when it was taken) and
    the bytes used in it."""

    __slots__ = ("map", "path", "use", "used")

    def __init__(self, path: str, mapping: mmap.mmap) -> None:
        self.path, self.map = path, mapping
        self.use, self.used = 0, HEADER_BYTES


class _Writer:
    """A worker process's segments, made up to the bound and reused once the
    main process has read them."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.limit = 0
        self.raise_thresholds = False
        self.owner = self.owner_for(os.getppid())
        self.uses = 0
        self.made = 0
        self.current: _Segment | None = None
        self.segments: list[_Segment] = []
        self.lock = threading.Lock()
        self.finalizer: util.Finalize | None = None

    def owner_for(self, main: int) -> str:
        """The start of this worker's segment names, handing to ``main``."""
        return f"{main_prefix(main)}{self.pid}-{secrets.token_hex(4)}"

    def segment_bytes(self) -> int:
        """The size of each segment: 4 MiB, or a quarter of the bound."""
        return min(SEGMENT_BYTES, self.limit // 4)

    def write(self, data: bytes) -> tuple[str, int, int, int, bool] | None:
        """Writes ``data`` into the current segment (or the next one) and
        gives its place (path, use, offset, length) and whether to raise the
        malloc thresholds, or ``None`` when it must go through the pipe."""
        n = len(data)
        with self.lock:
            segment = self.current
            if segment is None or segment.used + n > len(segment.map):
                segment = self._next_segment(n)
                if segment is None:
                    return None
            start = segment.used
            segment.map[start : start + n] = data
            segment.used += n
            return (segment.path, segment.use, start, n, self.raise_thresholds)

    def _next_segment(self, n: int) -> _Segment | None:
        """A segment with room for ``n`` bytes for the next members: one the
        main process is done with, or a new one within the bound; ``None``
        if there is none."""
        self.current = None
        for done in [s for s in self.segments if s.map[0] == DONE and s.map[1] == ONE_OFF]:
            done.map.close()
            self.segments.remove(done)
        size = self.segment_bytes()
        segment = None
        if HEADER_BYTES + n > size:
            size = HEADER_BYTES + n
        else:
            segment = next((s for s in self.segments if s.map[0] == DONE), None)
        if segment is None:
            if sum(len(s.map) for s in self.segments) + size > self.limit:
                return None
            segment = self._new_segment(size)
            if segment is None:
                return None
            if size > self.segment_bytes():
                segment.map[1] = ONE_OFF
        segment.map[0] = 0
        self.uses += 1
        segment.use, segment.used = self.uses, HEADER_BYTES
        self.current = segment
        return segment

    def _new_segment(self, size: int) -> _Segment | None:
        """A new segment of ``size`` bytes, its memory reserved (so that a
        full /dev/shm is an error here, never a ``SIGBUS`` later) and mapped."""
        path = str(SHM_DIR / f"{self.owner}-{self.made}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        finally:
            os.close(fd)
        if self.finalizer is None:
            # Runs when the worker process exits normally (multiprocessing
            # calls its finalizers then), fork or spawn.
            self.finalizer = util.Finalize(self, _remove_paths, (self.segments,), exitpriority=10)
        segment = _Segment(path, mapping)
        self.made += 1
        self.segments.append(segment)
        return segment


def _remove_paths(segments: list[_Segment]) -> None:
    """Removes the segments of a worker that exits that the main process has
    not opened."""
    for segment in segments:
        with contextlib.suppress(OSError):
            os.unlink(segment.path)


# Pages mapped at once rather than faulted in one by one (Linux).
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)

_WRITER: _Writer | None = None


def _writer() -> _Writer:
    """This process's writer (a forked child makes its own)."""
    global _WRITER
    if _WRITER is None or _WRITER.pid != os.getpid():
        _WRITER = _Writer()
    return _WRITER


# --- the main process ---------------------------------------------------------


class _Received:
    """The segments of one worker mapped here, and the use being read."""

    __slots__ = ("current", "maps")

    def __init__(self) -> None:
        self.maps: dict[str, mmap.mmap] = {}
        # (path, use) of the segment use read last.
        self.current: tuple[str, int] | None = None


# By owner (a segment's path up to its number).
_OPEN: dict[str, _Received] = {}
_READ_LOCK = threading.Lock()
_REAPER: threading.Thread | None = None
_SWEPT = False
# Whether this process has raised glibc's malloc thresholds (once is enough).
_THRESHOLDS_RAISED = False


def read_shared(
    path: str, use: int, offset: int, length: int, raise_thresholds: bool = False
) -> bytes:
    """The ``length`` bytes at ``offset`` of use ``use`` of the segment at
    ``path``, which a DataLoader worker wrote. A segment is mapped (and
    unlinked) the first time; when the worker's next segment use is reached,
    the previous one is marked done, for the worker to reuse.
    ``raise_thresholds``: raise glibc's malloc thresholds in this process
    first, if not done yet."""
    global _REAPER, _THRESHOLDS_RAISED
    owner = path.rpartition("-")[0]
    with _READ_LOCK:
        if raise_thresholds and not _THRESHOLDS_RAISED:
            _raise_malloc_thresholds()
            _THRESHOLDS_RAISED = True
        received = _OPEN.get(owner)
        if received is None:
            received = _OPEN[owner] = _Received()
        current = received.current
        if current is None or current != (path, use):
            if current is not None and use < current[1]:
                raise ShardReadError(
                    f"{path}: shared-memory segment use {use} of a DataLoader worker read after "
                    f"its use {current[1]} (only the DataLoader's own result queue may carry "
                    "its samples by reference)"
                )
            mapping = received.maps.get(path)
            if mapping is None:
                mapping = received.maps[path] = _map_segment(path)
                if _REAPER is None or not _REAPER.is_alive():
                    _REAPER = threading.Thread(
                        target=_reap, name="shardstream-shm-reaper", daemon=True
                    )
                    _REAPER.start()
            if current is not None:
                done = received.maps[current[0]]
                done[0] = DONE
                if done[1] == ONE_OFF:
                    done.close()
                    del received.maps[current[0]]
            received.current = (path, use)
        else:
            mapping = received.maps[path]
        if offset < HEADER_BYTES or offset + length > len(mapping):
            raise ShardReadError(
                f"{path}: read failed at byte offset {offset} of a shared-memory segment: "
                f"it ends at {len(mapping)}, before the {length} bytes a DataLoader worker "
                "wrote there"
            )
        return mapping[offset : offset + length]


def _map_segment(path: str) -> mmap.mmap:
    """Maps the segment at ``path`` and unlinks it (the lock is held)."""
    _sweep_gone_mains()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as error:
        raise ShardReadError(
            f"{path}: the shared-memory segment a DataLoader worker handed a sample "
            f"through is gone (was the worker stopped, or /dev/shm cleared?): {error}"
        ) from error
    try:
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
    except (OSError, ValueError) as error:
        raise ShardReadError(
            f"{path}: cannot map the shared-memory segment a DataLoader worker handed a "
            f"sample through: {error}"
        ) from error
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)


def _reap() -> None:
    """While segments of workers are open here: every ``REAP_INTERVAL``
    seconds, closes and removes those of workers that are gone."""
    while True:
        time.sleep(REAP_INTERVAL)
        with _READ_LOCK:
            if not _release_gone_workers():
                return


def _release_gone_workers() -> bool:
    """Closes the segments held of workers that are gone and removes every
    segment named after this process and such a worker (the lock is held).
    Whether segments of workers that run remain, open or named."""
    for owner in list(_OPEN):
        if not _alive(_worker_of(owner)):
            _close(_OPEN.pop(owner))
    remain = bool(_OPEN)
    for path in SHM_DIR.glob(f"{main_prefix()}*"):
        worker = _worker_of(path.name)
        if worker is not None and not _alive(worker):
            with contextlib.suppress(OSError):
                path.unlink()
        else:
            remain = True
    return remain


def release_all() -> None:
    """Closes every segment held here and removes every segment named after
    this process (at exit, or when this process has no more workers)."""
    with _READ_LOCK:
        for received in _OPEN.values():
            _close(received)
        _OPEN.clear()
        for path in SHM_DIR.glob(f"{main_prefix()}*"):
            with contextlib.suppress(OSError):
                path.unlink()


def _close(received: _Received) -> None:
    """Unmaps a worker's segments (their memory is freed once the worker has
    unmapped them too, or exited)."""
    for mapping in received.maps.values():
        mapping.close()
    received.maps.clear()


def _sweep_gone_mains() -> None:
    """Once per process: removes segments named after main processes that
    are gone (a main process killed before it could remove them)."""
    global _SWEPT
    if _SWEPT:
        return
    _SWEPT = True
    for path in SHM_DIR.glob(f"{PREFIX}{_NAMESPACE}-*"):
        main = _number(path.name[len(PREFIX) :].split("-")[1])
        if main is not None and not _alive(main):
            with contextlib.suppress(OSError):
                path.unlink()


def _worker_of(name: str) -> int | None:
    """The worker's process id in a segment's name or path (or owner)."""
    parts = os.path.basename(name)[len(PREFIX) :].split("-")
    return _number(parts[2]) if len(parts) > 2 else None


def _number(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def _alive(pid: int | None) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet waited for,
    does not)."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # The state follows the parenthesized command name.
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X", b"x")


def _after_fork_in_child() -> None:
    """A forked child holds none of its parent's segments."""
    global _REAPER, _SWEPT, _READ_LOCK
    for received in _OPEN.values():
        _close(received)
    _OPEN.clear()
    _READ_LOCK = threading.Lock()
    _REAPER = None
    _SWEPT = False


os.register_at_fork(after_in_child=_after_fork_in_child)
util.Finalize(None, release_all, exitpriority=10)

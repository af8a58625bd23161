"""Field bytes of remote, compressed and cached shards that cross from a
DataLoader worker to the main process through shared memory rather than
through the worker's pipe.

In a DataLoader worker, a member of 16 KiB or more that is not a view of a
local shard (``shardstream.local_bytes``) is handed out as ``SharedBytes``:
``bytes`` in every way, but ``multiprocessing``'s pickler
(``ForkingPickler``, which the DataLoader's worker result queue pickles
batches with) writes its bytes into a shared-memory segment of the worker (a
file in ``/dev/shm``) and pickles their place there (segment, offset,
length). The DataLoader's main process opens each segment once, unlinks it
at once (its name is gone from ``/dev/shm`` as soon as it is opened), and
reads each member from it into a plain ``bytes``: one copy in each process
instead of a pickle, a pipe write, a pipe read and an unpickle of every byte.
Plain ``pickle`` (and ``copy``) gives the bytes themselves.

Bounded: a worker keeps at most ``worker_shared_memory_bytes`` (a dataset
option, 64 MiB by default) in segments that are alive (named and not yet
opened by the main process, or still open there); a member that would pass
the bound, or that the shared-memory file system has no room for, goes
through the pipe as before. Segments are 4 MiB, or a quarter of the bound if
that is less (a longer member gets one of its own size); the main process
keeps one segment of each worker open, the one it reads from, and closes it
when it reaches the worker's next one.

Freed: a segment's memory goes back to the system when both processes have
closed it. Members handed to the consumer are plain ``bytes`` copies, so the
consumer keeps them as long as it likes, after the epoch too.

Crash-safe: a segment's name carries the pid namespace, the main process's
id, the worker's id and a random token
(``shardstream-<namespace>-<main>-<worker>-<token>-<n>``). A worker
removes its segments that remain when it exits (the DataLoader stops
reading from a worker only when it shuts the workers down). The main process
checks, twice a second while it holds segments of workers, which of those
workers are gone, and removes their segments (a worker killed mid-epoch);
at exit it removes every segment named after it; and the first time it
reads a segment it removes those named after main processes that are gone.
"""

from __future__ import annotations

import contextlib
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
# How often the main process looks for workers that are gone, in seconds.
REAP_INTERVAL = 0.5


class SharedBytes(bytes):
    """``bytes`` of a member that ``multiprocessing`` pickles as its place in
    a shared-memory segment of this process, unpickled as a plain ``bytes``
    read from there; plain ``pickle`` gives a plain ``bytes`` of the data."""

    __slots__ = ()

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (bytes, (bytes(self),))


def configure(limit: int) -> None:
    """Sets this process's bound on live shared memory (bytes; 0: every
    member goes through the pipe)."""
    _writer().limit = limit


def _reduce_shared(value: SharedBytes) -> tuple[Callable[..., bytes], tuple[Any, ...]]:
    """``ForkingPickler``'s reduction of a ``SharedBytes``: written into this
    worker's current segment, pickled as its place there; when the bound or
    the file system leaves no room, pickled as the bytes themselves."""
    place = _writer().write(value)
    if place is None:
        return (bytes, (bytes(value),))
    return (read_shared, place)


ForkingPickler.register(SharedBytes, _reduce_shared)


class _Segment:
    """One segment a worker made: its path, size, and the descriptor it
    writes through while it is the current one."""

    __slots__ = ("fd", "path", "size", "used")

    def __init__(self, path: str, size: int, fd: int) -> None:
        self.path, self.size, self.fd, self.used = path, size, fd, 0


class _Writer:
    """A worker process's segments: the current one, and those made before
    that may still be alive."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.limit = 0
        # The DataLoader's main process is the worker's parent.
        self.owner = f"{main_prefix(os.getppid())}{self.pid}-{secrets.token_hex(4)}"
        self.count = 0
        self.current: _Segment | None = None
        # Made and not yet known to be freed, oldest first (the current one last).
        self.segments: list[_Segment] = []
        self.lock = threading.Lock()
        self.finalizer: util.Finalize | None = None

    def write(self, data: bytes) -> tuple[str, int, int] | None:
        """Writes ``data`` into the current segment (or a new one) and gives
        its place, or ``None`` when it must go through the pipe."""
        n = len(data)
        with self.lock:
            segment = self.current
            if segment is None or segment.used + n > segment.size:
                segment = self._next_segment(n)
                if segment is None:
                    return None
            try:
                written = os.pwrite(segment.fd, data, segment.used)
            except OSError:
                written = -1
            if written != n:
                # No room left in the file system: this member, and the
                # rest of this segment, go through the pipe.
                self._close_current()
                return None
            place = (segment.path, segment.used, n)
            segment.used += n
            return place

    def _next_segment(self, n: int) -> _Segment | None:
        """Closes the current segment and makes the next one, big enough for
        ``n`` bytes, if the bound leaves room for it."""
        self._close_current()
        size = max(min(SEGMENT_BYTES, self.limit // 4), n)
        if self._alive_bytes() + size > self.limit:
            return None
        path = str(SHM_DIR / f"{self.owner}-{self.count}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        self.count += 1
        if self.finalizer is None:
            # Runs when the worker process exits normally (multiprocessing
            # calls its finalizers then), fork or spawn.
            self.finalizer = util.Finalize(self, _remove_paths, (self.segments,), exitpriority=10)
        segment = _Segment(path, size, fd)
        self.current = segment
        self.segments.append(segment)
        return segment

    def _close_current(self) -> None:
        if self.current is not None:
            os.close(self.current.fd)
            self.current.fd = -1
            self.current = None

    def _alive_bytes(self) -> int:
        """Bytes of segments that may still hold memory: those still named
        (the main process has not opened them), the last one it has opened
        (it may still hold it open) and the current one; older ones are
        forgotten."""
        newest_opened = -1
        for i, segment in enumerate(self.segments):
            if segment is not self.current and not os.path.exists(segment.path):
                newest_opened = i
        if newest_opened > 0:
            del self.segments[:newest_opened]
        return sum(segment.size for segment in self.segments)


def _remove_paths(segments: list[_Segment]) -> None:
    """Removes the named segments of a worker that exits."""
    for segment in segments:
        with contextlib.suppress(OSError):
            os.unlink(segment.path)


_WRITER: _Writer | None = None


def _writer() -> _Writer:
    """This process's writer (a forked child makes its own)."""
    global _WRITER
    if _WRITER is None or _WRITER.pid != os.getpid():
        _WRITER = _Writer()
    return _WRITER


# --- the main process ---------------------------------------------------------

# Open segments by owner (the name up to the segment number): (number, fd).
_OPEN: dict[str, tuple[int, int]] = {}
_READ_LOCK = threading.Lock()
_REAPER: threading.Thread | None = None
_SWEPT = False


def read_shared(path: str, offset: int, length: int) -> bytes:
    """The ``length`` bytes at ``offset`` of the segment at ``path``, which a
    DataLoader worker wrote: the segment is opened (and unlinked) the first
    time, and kept open until the same worker's next segment is read."""
    global _REAPER
    owner, _, number_text = path.rpartition("-")
    number = int(number_text)
    with _READ_LOCK:
        held = _OPEN.get(owner)
        if held is None or held[0] != number:
            if held is not None and number < held[0]:
                raise ShardReadError(
                    f"{path}: shared-memory segment {number} of a DataLoader worker read after "
                    f"its segment {held[0]} (only the DataLoader's own result queue may carry "
                    "its samples by reference)"
                )
            _sweep_gone_mains()
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as error:
                raise ShardReadError(
                    f"{path}: the shared-memory segment a DataLoader worker handed a sample "
                    f"through is gone (was the worker stopped, or /dev/shm cleared?): {error}"
                ) from error
            with contextlib.suppress(OSError):
                os.unlink(path)
            if held is not None:
                os.close(held[1])
            _OPEN[owner] = (number, fd)
            if _REAPER is None or not _REAPER.is_alive():
                _REAPER = threading.Thread(target=_reap, name="shardstream-shm-reaper", daemon=True)
                _REAPER.start()
        else:
            fd = held[1]
        try:
            data = os.pread(fd, length, offset)
        except OSError as error:
            raise ShardReadError(
                f"{path}: read failed at byte offset {offset} of a shared-memory segment: {error}"
            ) from error
    if len(data) != length:
        raise ShardReadError(
            f"{path}: read failed at byte offset {offset + len(data)} of a shared-memory "
            f"segment: it ends before the {length} bytes a DataLoader worker wrote there"
        )
    return data


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
            os.close(_OPEN.pop(owner)[1])
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
        for _, fd in _OPEN.values():
            os.close(fd)
        _OPEN.clear()
        for path in SHM_DIR.glob(f"{main_prefix()}*"):
            with contextlib.suppress(OSError):
                path.unlink()


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
    for _, fd in _OPEN.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _OPEN.clear()
    _READ_LOCK = threading.Lock()
    _REAPER = None
    _SWEPT = False


os.register_at_fork(after_in_child=_after_fork_in_child)
util.Finalize(None, release_all, exitpriority=10)

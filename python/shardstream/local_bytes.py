"""Field bytes of local shards that cross from a DataLoader worker to the main
process as a reference to their file rather than through the worker's pipe.

In a DataLoader worker, a tar member of a local (memory-mapped) shard that is
16 KiB or longer is handed out as ``LocalBytes``: ``bytes`` in every way, but
``multiprocessing``'s pickler (``ForkingPickler``, which the DataLoader's
worker result queue pickles batches with) writes it as the member's place in
its shard (path, offset, length and the file's identity). The process that
unpickles it, the DataLoader's main process, reads those bytes from the file
(its pages are in the page cache: the worker has just read them) into a plain
``bytes``. The batch then costs one copy in the main process instead of a
pickle, a pipe write, a pipe read and an unpickle of every byte.

Plain ``pickle`` (and ``copy``) gives the bytes themselves: a sample pickled
in a worker for anything else (a cache, a queue to another host) holds its
data, not a reference to a file that may be gone or elsewhere.

With ``raise_malloc_thresholds`` (the dataset's default), the first read
in a process also raises glibc's malloc thresholds there (mmap 32 MiB, trim
64 MiB, where glibc's own adaptive rule puts them after a 32 MiB block is
freed): each batch's bytes then reuse the heap the previous batch freed,
instead of glibc returning it to the kernel and the next batch faulting it
in again page by page.

Shards must not change while they are read. A shard replaced since the worker
opened it (another device, inode, size or modification time) raises
``ObjectChangedError``; a shard gone or cut short raises
``ShardNotFoundError`` or ``ShardReadError``, naming the shard and offset.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ._core import ObjectChangedError, ShardNotFoundError, ShardReadError
from ._core import raise_malloc_thresholds as _raise_malloc_thresholds

# (path, identity) -> open descriptor, least recently used first.
_OPEN: OrderedDict[tuple[str, tuple[int, int, int, int]], int] = OrderedDict()
_OPEN_MAX = 64
# Reads happen under the lock too, so that no descriptor is closed (and its
# number reused) while another thread reads from it.
_LOCK = threading.Lock()
# Whether this process has raised glibc's malloc thresholds (once is enough).
_THRESHOLDS_RAISED = False


class LocalBytes(bytes):
    """``bytes`` of a local shard's member that ``multiprocessing`` pickles
    as where they are in the shard, unpickled as a plain ``bytes`` read from
    there; plain ``pickle`` gives a plain ``bytes`` of the data."""

    _origin: tuple[str, int, int, tuple[int, int, int, int], bool]

    def __new__(
        cls,
        data: bytes,
        path: str,
        offset: int,
        dev: int,
        ino: int,
        size: int,
        mtime_ns: int,
        *,
        raise_malloc_thresholds: bool = False,
    ) -> LocalBytes:
        self = super().__new__(cls, data)
        self._origin = (
            path,
            offset,
            len(data),
            (dev, ino, size, mtime_ns),
            raise_malloc_thresholds,
        )
        return self

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (bytes, (bytes(self),))


def _reduce_by_reference(value: LocalBytes) -> tuple[Callable[..., bytes], tuple[Any, ...]]:
    """``ForkingPickler``'s reduction of a ``LocalBytes``: its place in the shard."""
    return (read_local, value._origin)


ForkingPickler.register(LocalBytes, _reduce_by_reference)


def read_local(
    path: str,
    offset: int,
    length: int,
    identity: tuple[int, int, int, int],
    raise_thresholds: bool = False,
) -> bytes:
    """The ``length`` bytes at ``offset`` of the shard at ``path``, which must
    still be the file of ``identity`` (device, inode, size, mtime in ns).
    ``raise_thresholds``: raise glibc's malloc thresholds in this process
    first, if not done yet."""
    global _THRESHOLDS_RAISED
    with _LOCK:
        if raise_thresholds and not _THRESHOLDS_RAISED:
            _raise_malloc_thresholds()
            _THRESHOLDS_RAISED = True
        fd = _descriptor(path, identity)
        try:
            data = os.pread(fd, length, offset)
        except OSError as error:
            raise ShardReadError(f"{path}: read failed at byte offset {offset}: {error}") from error
    if len(data) != length:
        raise ShardReadError(
            f"{path}: read failed at byte offset {offset + len(data)}: the file ends "
            f"before the {length} bytes a DataLoader worker read there"
        )
    return data


def _descriptor(path: str, identity: tuple[int, int, int, int]) -> int:
    """An open descriptor of ``path`` as of ``identity`` (cached; the lock is held)."""
    key = (path, (identity[0], identity[1], identity[2], identity[3]))
    fd = _OPEN.get(key)
    if fd is not None:
        _OPEN.move_to_end(key)
        return fd
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as error:
        raise ShardNotFoundError(f"{path}: not found: {error}") from error
    except OSError as error:
        raise ShardReadError(f"{path}: read failed at byte offset 0: {error}") from error
    st = os.fstat(fd)
    now = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if now != tuple(identity):
        os.close(fd)
        raise ObjectChangedError(
            f"{path}: the shard changed after a DataLoader worker read it "
            f"(device, inode, size, mtime_ns {tuple(identity)} then, {now} now)"
        )
    _OPEN[key] = fd
    while len(_OPEN) > _OPEN_MAX:
        _, oldest = _OPEN.popitem(last=False)
        os.close(oldest)
    return fd

"""``StreamingDataset``: a torch ``IterableDataset`` over tar shards."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from ._core import Counters, SampleStream, resolve_shards

__all__ = ["StreamingDataset"]

OnError = Literal["raise", "warn"]


class StreamingDataset(IterableDataset[dict[str, Any]]):
    """Streams samples from WebDataset tar shards, split across ranks and
    DataLoader workers before any byte is read.

    Each sample is a dict: ``__key__`` (str), ``__url__`` (the shard, str) and
    one ``bytes`` value per field (the member's extension, lower-cased).

    Args:
        urls: a path, ``file://`` URL, brace pattern
            (``data/shard-{000000..000127}.tar``) or directory (its ``*.tar``
            files, sorted), or a list of them.
        seed: seed of the shard order and the shuffle buffer.
        shuffle_shards: shuffle the shard order every epoch.
        shuffle_buffer: shuffle buffer size in samples; 0 disables it.
        shuffle_buffer_bytes: byte budget of the shuffle buffer.
        read_ahead_bytes: bytes each worker reads ahead of its parser.
        rank, world_size: this process's place in the job; ``None`` takes them
            from ``torch.distributed`` when initialised, else from the
            ``RANK``/``WORLD_SIZE`` environment variables, else 0 and 1.
        num_workers, worker_id: override the DataLoader worker info (mostly
            for tests and custom launchers).
        on_error: ``"raise"`` ends the epoch with the error; ``"warn"`` skips
            the rest of a bad shard with a ``ShardSkippedWarning`` and counts it.
        io_timeout: seconds to wait for the next bytes of a shard.
    """

    def __init__(
        self,
        urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        seed: int = 0,
        shuffle_shards: bool = True,
        shuffle_buffer: int = 1000,
        shuffle_buffer_bytes: int = 256 << 20,
        read_ahead_bytes: int = 32 << 20,
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int | None = None,
        worker_id: int | None = None,
        on_error: OnError = "raise",
        io_timeout: float = 120.0,
    ) -> None:
        super().__init__()
        specs = (
            [os.fspath(urls)]
            if isinstance(urls, (str, os.PathLike))
            else [os.fspath(u) for u in urls]
        )
        if on_error not in ("raise", "warn"):
            raise ValueError(f'on_error must be "raise" or "warn", got {on_error!r}')
        self.shards: list[tuple[str, int | None]] = resolve_shards(specs)
        self.seed = seed
        self.shuffle_shards = shuffle_shards
        self.shuffle_buffer = shuffle_buffer
        self.shuffle_buffer_bytes = shuffle_buffer_bytes
        self.read_ahead_bytes = read_ahead_bytes
        self.rank = rank
        self.world_size = world_size
        self.num_workers = num_workers
        self.worker_id = worker_id
        self.on_error: OnError = on_error
        self.io_timeout = io_timeout
        self.epoch = 0
        self._counters = Counters()

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch; the shard order and shuffle follow ``(seed, epoch)``.

        Call it before creating the epoch's DataLoader iterator (workers copy
        the dataset when they start; with ``persistent_workers=True`` they
        keep the epoch they started with).
        """
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}")
        self.epoch = epoch

    def distributed_slot(self) -> tuple[int, int]:
        """``(rank, world_size)``: explicit arguments, else torch.distributed,
        else ``RANK``/``WORLD_SIZE``, else ``(0, 1)``."""
        if dist.is_available() and dist.is_initialized():
            auto_rank, auto_world = dist.get_rank(), dist.get_world_size()
        else:
            auto_rank = int(os.environ.get("RANK", "0"))
            auto_world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = auto_rank if self.rank is None else self.rank
        world_size = auto_world if self.world_size is None else self.world_size
        return rank, world_size

    def worker_slot(self) -> tuple[int, int]:
        """``(worker_id, num_workers)``: explicit arguments, else the DataLoader
        worker info, else ``(0, 1)``."""
        info = get_worker_info()
        worker_id = self.worker_id if self.worker_id is not None else (info.id if info else 0)
        num_workers = (
            self.num_workers if self.num_workers is not None else (info.num_workers if info else 1)
        )
        return worker_id, num_workers

    def __iter__(self) -> Iterator[dict[str, Any]]:
        rank, world_size = self.distributed_slot()
        worker_id, num_workers = self.worker_slot()
        return SampleStream(
            self.shards,
            epoch=self.epoch,
            world_size=world_size,
            rank=rank,
            num_workers=num_workers,
            worker_id=worker_id,
            seed=self.seed,
            shuffle_shards=self.shuffle_shards,
            shuffle_buffer=self.shuffle_buffer,
            shuffle_buffer_bytes=self.shuffle_buffer_bytes,
            read_ahead_bytes=self.read_ahead_bytes,
            on_error=self.on_error,
            io_timeout=self.io_timeout,
            counters=self._counters,
        )

    def stats(self) -> dict[str, int]:
        """Counters over every epoch iterated so far: ``shards_opened``,
        ``shards_completed``, ``samples``, ``bytes_read``, ``errors_skipped``.

        DataLoader workers forked from this process add to the same counters;
        workers started with the ``spawn`` method count in their own copy.
        """
        return self._counters.snapshot()

    def __repr__(self) -> str:
        return (
            f"StreamingDataset({len(self.shards)} shards, seed={self.seed}, "
            f"shuffle_shards={self.shuffle_shards}, shuffle_buffer={self.shuffle_buffer}, "
            f"epoch={self.epoch}, on_error={self.on_error!r})"
        )

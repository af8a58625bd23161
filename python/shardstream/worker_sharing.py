"""What DataLoader workers share with the process that made the dataset,
whatever their start method: the ``EpochTable`` (the epoch of each worker's
next iteration) and the stream ``Counters`` (``stats()``).

Both live in shared memory, which forked workers inherit. For workers
started with ``spawn`` or ``forkserver``, ``multiprocessing`` pickles them
(with its ``ForkingPickler``) as their memory's file descriptor, so that the
worker attaches to the same memory: it advances the same epochs and adds to
the same counters as the main process reads. Plain ``pickle`` gives an
unshared copy of the epochs and fresh counters instead.

Importing this module registers how; ``shardstream.epochs``, which every
dataset and mixture imports, imports it.
"""

from __future__ import annotations

import warnings
from multiprocessing.reduction import DupFd, ForkingPickler
from typing import Any

from ._core import Counters, EpochTable

__all__: list[str] = []


def _no_shared_memory(what: str, consequence: str) -> None:
    warnings.warn(
        f"no shareable memory for the {what} on this system: DataLoader workers started "
        f"with spawn or forkserver {consequence}",
        RuntimeWarning,
        stacklevel=3,
    )


def _share_epoch_table(table: EpochTable) -> tuple[Any, tuple[Any, ...]]:
    """An epoch table for a process ``multiprocessing`` starts: its memory's
    descriptor, so that the worker advances the same epochs as the main
    process (an unshared copy where the table has no descriptor)."""
    fd = table.fd()
    if fd is None:
        _no_shared_memory(
            "epoch table", "keep epochs of their own; call set_epoch before each epoch"
        )
        return (EpochTable._from_values, (table.values(),))
    return (_attach_epoch_table, (DupFd(fd),))


def _attach_epoch_table(shared: Any) -> EpochTable:
    """Unpickles a shared epoch table in the process it was handed to."""
    return EpochTable._attach(shared.detach())


def _share_counters(counters: Counters) -> tuple[Any, tuple[Any, ...]]:
    """Stream counters for a process ``multiprocessing`` starts: their
    memory's descriptor, so that the worker's streams count in the main
    process's ``stats()`` (fresh counters where they have no descriptor)."""
    fd = counters.fd()
    if fd is None:
        _no_shared_memory(
            "stream counters", "count in their own copy, which stats() in this process does not see"
        )
        return (Counters, ())
    return (_attach_counters, (DupFd(fd),))


def _attach_counters(shared: Any) -> Counters:
    """Unpickles shared counters in the process they were handed to."""
    return Counters._attach(shared.detach())


ForkingPickler.register(EpochTable, _share_epoch_table)
ForkingPickler.register(Counters, _share_counters)

"""Finding a framework wrapper that would split a dataset between ranks a
second time: Accelerate's ``IterableDatasetShard`` and
``DataLoaderDispatcher`` around a dataset that splits the data between
ranks itself (``StreamingDataset``, ``Mix``), and the error that names it.
The datasets check at their first batch; ``shardstream.accelerate``
prepares loaders so that nothing splits them again.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from ._core import ShardStreamError

__all__ = ["FrameworkWrapperError", "check_not_resplit", "find_splitter"]

_ACCELERATE_MODULE = "accelerate.data_loader"
_SPLITTERS = ("IterableDatasetShard", "DataLoaderDispatcher")

FIX = (
    "prepare the DataLoader with shardstream.accelerate.prepare_loader(accelerator, loader) "
    "instead of accelerator.prepare(loader) (the model and optimizer still go through "
    "accelerator.prepare); with the HF Trainer, use shardstream.transformers.StreamingTrainer "
    "(see docs/integrations.md)"
)


class FrameworkWrapperError(ShardStreamError):
    """A training framework wrapped the dataset or its DataLoader in a way
    that would split the data between ranks a second time, so that a job
    of N ranks would train on 1/N of it, or was set up for another number
    of processes than the job has, so that its ranks would not train one
    model together. The message names the cause and the fix."""


def _splitter(obj: Any) -> str | None:
    """The name of Accelerate's splitting wrapper ``obj`` is, or ``None``."""
    cls = type(obj)  # not obj.__class__: Accelerate's loaders report the wrapped class
    if cls.__module__ == _ACCELERATE_MODULE and cls.__name__ in _SPLITTERS:
        return cls.__name__
    return None


def find_splitter(dataset: Any) -> str | None:
    """The Accelerate wrapper that is iterating ``dataset`` and splitting it
    between processes, or ``None``: the DataLoader worker's dataset (an
    ``IterableDatasetShard`` around ours), else the frames of the calling
    stack (the main process; a forked worker inherits its parent's): a
    method of the wrapper (its ``__iter__``, or the ``__init__`` of a
    ``DataLoaderDispatcher`` over a ``StatefulDataLoader``, which starts an
    iterator to read its first state)."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is not None and info.dataset is not dataset:
        name = _splitter(info.dataset)
        if name is not None:
            return name
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == _ACCELERATE_MODULE:
            name = _splitter(frame.f_locals.get("self"))
            if name is not None:
                return name
        frame = frame.f_back
    return None


def check_not_resplit(dataset: Any, world_size: int) -> None:
    """Raises ``FrameworkWrapperError`` when ``dataset``, split between
    ``world_size`` ranks already, is being iterated through one of
    Accelerate's wrappers that split it again. With one rank they split
    nothing, and are let be."""
    if world_size <= 1:
        return
    from torch.utils.data import get_worker_info

    name = find_splitter(dataset)
    if name is None and get_worker_info() is not None:
        # A worker started with spawn or forkserver: the wrapper that was
        # iterating the loader when the dataset was pickled for it.
        name = dataset.__dict__.get("_pickled_under")
    if name is None:
        return
    how = (
        "rank 0 alone iterates the DataLoader and hands slices of its batches to the other ranks"
        if name == "DataLoaderDispatcher"
        else "each rank keeps 1/N of the samples its dataset gives it"
    )
    raise FrameworkWrapperError(
        f"accelerate's {name} wraps this {type(dataset).__name__}, which already gives each of "
        f"the {world_size} ranks its own part of the data: {how}, so the job would train on "
        f"1/{world_size} of the data each epoch. Fix: {FIX}"
    )

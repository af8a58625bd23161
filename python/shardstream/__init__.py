"""shardstream: deterministic, shard-aware streaming of WebDataset tar shards
into PyTorch.

``import shardstream`` does not import torch; ``shardstream.StreamingDataset``
does, on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._core import (
    DatasetSpecError,
    ShardFormatError,
    ShardNotFoundError,
    ShardReadError,
    ShardSkippedWarning,
    ShardStreamError,
    StorageAuthError,
    __version__,
    plan_epoch,
    resolve_shards,
)

if TYPE_CHECKING:
    from .dataset import StreamingDataset

__all__ = [
    "DatasetSpecError",
    "ShardFormatError",
    "ShardNotFoundError",
    "ShardReadError",
    "ShardSkippedWarning",
    "ShardStreamError",
    "StorageAuthError",
    "StreamingDataset",
    "__version__",
    "plan_epoch",
    "resolve_shards",
]


def __getattr__(name: str) -> Any:
    if name == "StreamingDataset":
        from .dataset import StreamingDataset

        return StreamingDataset
    raise AttributeError(f"module 'shardstream' has no attribute {name!r}")

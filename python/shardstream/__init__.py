"""shardstream: deterministic, shard-aware streaming of WebDataset tar shards
into PyTorch.

``import shardstream`` does not import torch; ``shardstream.StreamingDataset``
does, on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._core import (
    AudioClip,
    DatasetSpecError,
    DecodeFieldWarning,
    FieldDecodeError,
    Image,
    ImageBoxes,
    ManifestError,
    ManifestIgnoredWarning,
    ManifestMismatchError,
    ObjectChangedError,
    Pack,
    SampleSkippedWarning,
    ShardFormatError,
    ShardNotFoundError,
    ShardReadError,
    ShardSkippedWarning,
    ShardStreamError,
    ShardWriteError,
    StateMismatchError,
    StorageAuthError,
    StreamProcessError,
    Tokenizer,
    TransformError,
    __version__,
    plan_epoch,
    plan_samples,
    resolve_shards,
)
from .accelerate import FrameworkWrapperError
from .ledger import Ledger
from .packing import collate_sequences
from .randomness import sample_generator, sample_rng, sample_seed
from .s3 import S3Config
from .state import elastic_state
from .worker_sharing import WorkerStartError
from .writer import ShardWriter

if TYPE_CHECKING:
    from .dataset import StreamingDataset
    from .mix import Mix

__all__ = [
    "AudioClip",
    "DatasetSpecError",
    "DecodeFieldWarning",
    "FieldDecodeError",
    "FrameworkWrapperError",
    "Image",
    "ImageBoxes",
    "Ledger",
    "ManifestError",
    "ManifestIgnoredWarning",
    "ManifestMismatchError",
    "Mix",
    "ObjectChangedError",
    "Pack",
    "S3Config",
    "SampleSkippedWarning",
    "ShardFormatError",
    "ShardNotFoundError",
    "ShardReadError",
    "ShardSkippedWarning",
    "ShardStreamError",
    "ShardWriteError",
    "ShardWriter",
    "StateMismatchError",
    "StorageAuthError",
    "StreamProcessError",
    "StreamingDataset",
    "Tokenizer",
    "TransformError",
    "WorkerStartError",
    "__version__",
    "collate_sequences",
    "elastic_state",
    "plan_epoch",
    "plan_samples",
    "resolve_shards",
    "sample_generator",
    "sample_rng",
    "sample_seed",
]


def __getattr__(name: str) -> Any:
    if name in ("StreamingDataset", "Mix"):
        try:
            import torch  # noqa: F401
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError(
                f"shardstream.{name} is a torch IterableDataset and needs PyTorch, which is not "
                "installed: pip install 'shardstream[torch]' (or install torch for your CUDA "
                "version first, see pytorch.org)",
                name="torch",
            ) from error
    if name == "StreamingDataset":
        from .dataset import StreamingDataset

        return StreamingDataset
    if name == "Mix":
        from .mix import Mix

        return Mix
    raise AttributeError(f"module 'shardstream' has no attribute {name!r}")

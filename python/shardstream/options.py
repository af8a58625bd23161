"""The typed face of the dataset options: their names and types.

The options are defined once, in the Rust core's option table (name, type,
default, text, and whether the option decides the sample order:
``shardstream._core.option_table()``), which also validates them
(``shardstream._core.Options``). ``DatasetOptions`` is its static copy for
type checkers; ``tests/python/test_option_drift.py`` fails when the two differ.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypedDict

from ._core import AudioClip, Image, ImageBoxes, Pack, Tokenizer
from .s3 import S3Config

__all__ = [
    "BatchFormat",
    "DatasetOptions",
    "Decoder",
    "Format",
    "OnError",
    "Remainder",
    "WriterOptions",
]

OnError = Literal["raise", "warn"]
Remainder = Literal["drop", "pad"]
Format = Literal["auto", "tar", "parquet", "raw", "jsonl"]
BatchFormat = Literal["dict", "arrow"]
Decoder = Literal["bytes", "str", "int", "json", "numpy", "audio", "rgb8"]


class DatasetOptions(TypedDict, total=False):
    """The keyword options of ``StreamingDataset`` (see its docstring)."""

    seed: int
    shuffle_shards: bool
    shuffle_buffer: int
    shuffle_buffer_bytes: int
    shuffle_initial: int
    read_ahead_bytes: int | None
    on_error: OnError
    io_timeout: float
    manifest: str | os.PathLike[str] | bool | None
    remainder: Remainder
    s3: S3Config | Mapping[str, Any] | None
    http_headers: Mapping[str, str] | None
    format: Format
    decode: bool | Mapping[str, Decoder | Image | ImageBoxes | AudioClip | Tokenizer] | None
    decode_threads: int | None
    columns: Sequence[str] | None
    batch_format: BatchFormat
    batch_size: int | None
    pack: Pack | None
    pack_bytes: bool
    local_bytes_by_reference: bool
    worker_shared_memory_bytes: int
    raise_malloc_thresholds: bool
    read_next_epoch_early: bool
    count_samples: bool | None
    transform: Callable[[Any], Any] | None
    sample_seed: bool
    sample_ids: bool
    model_parallel_size: int
    cache_dir: str | os.PathLike[str] | None
    cache_limit_bytes: int | None


class WriterOptions(TypedDict, total=False):
    """The keyword options of ``ShardWriter`` (see its docstring)."""

    max_count: int | None
    max_bytes: int | None
    compression: Literal["gz", "zst"] | None
    s3: S3Config | Mapping[str, Any] | None

"""``ShardWriter``: write samples into WebDataset tar shards, locally or to
S3, with the manifest that datasets use for equal-length epochs and
``len()``. The writing is done by the Rust core; see ``docs/writing.md``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from . import _core

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import WriterOptions
    from .s3 import S3Config

__all__ = ["ShardWriter", "write_manifest"]


class ShardWriter:
    """Writes samples into shards named by ``pattern``.

    Args:
        pattern: ``"out/shard-%06d.tar"`` or
            ``"s3://bucket/prefix/shard-%06d.tar"``: one ``%d`` (``%06d``,
            ...) in the file name, numbered from 0; it ends in ``.tar``,
            ``.tar.gz``/``.tgz`` or ``.tar.zst`` as the compression says.
            A missing local directory is made.
        max_count: samples per shard at most (``None``: no limit;
            default 100 000).
        max_bytes: tar bytes per shard at most, headers included and before
            compression (``None``: no limit; default 3 000 000 000). A
            sample that alone is larger goes in a shard of its own.
        compression: ``None`` (as the pattern's suffix says: plain for
            ``.tar``), ``"gz"`` or ``"zst"``.
        s3: ``shardstream.S3Config`` (or a dict of its fields) for S3
            patterns: credentials, endpoint, retries as for datasets;
            ``part_size`` is the multipart upload's part size (at least
            5 MiB).

    Options are checked here (``ValueError``/``TypeError`` naming the
    option). ``write(sample)`` takes a dict with a ``str`` ``__key__`` and
    fields: ``bytes`` as they are, ``str`` as UTF-8, numbers and dicts or
    lists encoded as webdataset encodes them (``docs/writing.md``). A key
    written twice, a field name that would not read back the same, or a
    value that cannot be encoded raises ``ValueError``/``TypeError`` naming
    the key and field, and writes nothing of that sample.

    Each shard is completed (renamed into place, or its multipart upload
    completed) when the next one starts and on ``close()``, and the
    ``manifest.json`` beside the shards is rewritten to list exactly the
    completed shards. Used as a context manager, an exception inside the
    ``with`` block aborts the open shard (its temporary file removed, or
    its upload aborted) and keeps the completed ones. A writer dropped
    without ``close()`` aborts the same way.
    """

    def __init__(self, pattern: str | os.PathLike[str], **options: Unpack[WriterOptions]) -> None:
        self._core = _core.ShardWriter(os.fspath(pattern), **options)
        self._pattern = os.fspath(pattern)

    def write(self, sample: Mapping[str, Any]) -> None:
        """Writes one sample (``__url__``, which datasets add, is left out)."""
        if isinstance(sample, Mapping) and not isinstance(sample, dict):
            sample = dict(sample)
        self._core.write(sample)  # type: ignore[arg-type]

    def close(self) -> None:
        """Completes the open shard and the manifest. Closing again does nothing."""
        self._core.close()

    def abort(self) -> None:
        """Abandons the open shard; the completed shards and their manifest stay."""
        self._core.abort()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __len__(self) -> int:
        """Samples written so far."""
        return len(self._core)

    @property
    def shards(self) -> list[str]:
        """Paths or URLs of the shards completed so far, in order (a new list
        each call; ``len(w.shards)`` counts them)."""
        return self._core.shard_urls

    @property
    def manifest_url(self) -> str:
        """Where the manifest is written (beside the shards)."""
        return self._core.manifest_url

    @property
    def manifest_json(self) -> str:
        """The manifest of the completed shards (JSON text), as written beside them."""
        return self._core.manifest_json

    def __repr__(self) -> str:
        return (
            f"ShardWriter({self._pattern!r}, {len(self)} samples, "
            f"{len(self.shards)} shards completed)"
        )


def write_manifest(
    url: str | os.PathLike[str],
    shards: Sequence[Mapping[str, Any]],
    *,
    s3: S3Config | Mapping[str, Any] | None = None,
) -> None:
    """Writes a manifest of ``shards`` (entries as ``manifest.json`` holds them,
    e.g. several writers' ``json.loads(w.manifest_json)["shards"]``) to ``url``:
    a local path (under a temporary name, then renamed into place) or an
    ``s3://`` URL (one ``PutObject``). The entries are checked as a manifest
    read is (``ManifestError`` naming ``url``)."""
    manifest = {"format": "shardstream.manifest", "version": 1, "shards": list(shards)}
    _core.write_manifest(os.fspath(url), json.dumps(manifest), s3=s3)

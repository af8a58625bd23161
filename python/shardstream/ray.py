"""Writing and indexing shards on a Ray cluster (``pip install shardstream[ray]``).

``ShardDatasink`` writes a ``ray.data.Dataset`` as WebDataset shards, one
``ShardWriter`` per write task, and then one ``manifest.json`` beside them;
``index`` runs ``shardstream index`` over a dataset's shards as Ray tasks and
merges their entries into one manifest. ``import shardstream`` does not
import this module (nor Ray); see ``docs/writing.md``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import ray  # type: ignore[import-untyped]
from ray.data import Datasink  # type: ignore[import-untyped]
from ray.data.block import BlockAccessor  # type: ignore[import-untyped]

from . import _core
from .s3 import S3Config
from .writer import write_manifest

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import WriterOptions

__all__ = ["ShardDatasink", "index"]

MANIFEST = "manifest.json"
SUFFIXES = {None: ".tar", "gz": ".tar.gz", "zst": ".tar.zst"}


def _join(root: str, name: str) -> str:
    return root.rstrip("/") + "/" + name


def _is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def _local(url: str) -> str:
    return url.removeprefix("file://")


def _listing(root: str, s3: Any) -> list[str]:
    """The shards (tar names) directly under ``root``; none if it is missing or empty."""
    options = _core.Options(format="tar", manifest=False, s3=s3)
    try:
        return _core.ShardList([root], options).urls
    except (_core.DatasetSpecError, _core.ShardNotFoundError):
        return []


class ShardDatasink(Datasink):  # type: ignore[misc]
    """A Ray Data datasink writing a dataset as WebDataset shards under ``path``.

    ``dataset.write_datasink(ShardDatasink("s3://bucket/train/", max_count=10_000))``

    Args:
        path: a local directory (made if missing) or an ``s3://bucket/prefix/``;
            it must hold no shards yet.
        prefix: the shards' names: write task ``t`` writes
            ``{prefix}-{t:06d}-{n:06d}.tar`` (``.tar.gz``, ``.tar.zst`` as
            ``compression`` says), ``n`` counting from 0 as ``ShardWriter`` does.
        max_count, max_bytes, compression, s3: as for ``ShardWriter``, per
            task (a task's last shard holds what is left of its rows).

    Each row is one sample: the ``__key__`` column (a ``str``) is its key,
    else ``{t:06d}-{i:09d}`` (the task and the row's position in it); every
    other column is a field, its value encoded as ``ShardWriter`` encodes it
    (a null leaves the field out of that sample). Keys are unique within a
    task; across tasks that is the dataset's to keep.

    Exactly once: a task's shard names depend only on the task's index and
    its rows, so a retried task (its worker killed, or an error Ray retries)
    writes the same names again, replacing what its earlier attempt
    completed; a shard is only ever seen whole (``ShardWriter`` renames it into
    place, or completes its upload). When every task has ended, the driver
    writes ``manifest.json`` from what the successful tasks report (what
    ``shardstream index`` would write for those shards), and removes any
    shard under ``path`` that no successful task reported, and the
    temporary files of killed attempts (locally; on S3 such a shard is named
    in a ``ShardWriteError`` after the manifest is written, and a killed
    attempt's pending upload is left to an ``AbortIncompleteMultipartUpload``
    lifecycle rule). Such a shard only arises if a task's rows change
    between attempts (a nondeterministic upstream).

    While the write runs, ``manifest.json`` under ``path`` is one task's (each
    task's writer keeps its own up to date): read the dataset once the write
    has returned.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        prefix: str = "shard",
        **options: Unpack[WriterOptions],
    ) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        if not prefix or any(c in prefix for c in "/%.") or not prefix.isprintable():
            raise ValueError(
                f"prefix must be a non-empty file name part without '/', '%' or '.', got {prefix!r}"
            )
        self.path = os.fspath(path)
        self.prefix = prefix
        s3 = options.get("s3")
        if isinstance(s3, Mapping):
            s3 = S3Config(**s3)
        if s3 is not None:
            options["s3"] = s3
        self.options: dict[str, Any] = dict(options)
        self.s3 = s3
        self.suffix = SUFFIXES.get(options.get("compression"), ".tar")
        # The options and the destination are checked here, as ShardWriter
        # checks them (a local directory is made; an S3 bucket is asked for).
        _core.ShardWriter(self._pattern(0), **self.options).abort()  # type: ignore[arg-type]

    @property
    def manifest_url(self) -> str:
        """Where the merged manifest is written."""
        return _join(self.path, MANIFEST)

    def _pattern(self, task: int) -> str:
        return _join(self.path, f"{self.prefix}-{task:06d}-%06d{self.suffix}")

    def _ours(self, name: str) -> bool:
        """Whether ``name`` (a file name) is one of this datasink's shard names."""
        head = f"{self.prefix}-"
        if not (name.startswith(head) and name.endswith(self.suffix)):
            return False
        numbers = name[len(head) : -len(self.suffix)].split("-")
        return len(numbers) == 2 and all(n.isdigit() for n in numbers)

    def on_write_start(self, schema: Any = None) -> None:
        """Refuses a ``path`` that already holds shards."""
        found = _listing(self.path, self.s3)
        if found:
            raise ValueError(
                f"path: {self.path} already holds {len(found)} shards ({found[0]}, ...); "
                "write into an empty directory or prefix"
            )

    def write(self, blocks: Iterable[Any], ctx: Any) -> dict[str, Any]:
        """Writes this task's rows; returns its shards' manifest entries."""
        task = int(ctx.task_idx)
        writer = _core.ShardWriter(self._pattern(task), **self.options)  # type: ignore[arg-type]
        rows = 0
        try:
            for block in blocks:
                table = BlockAccessor.for_block(block).to_arrow()
                for batch in table.to_batches():
                    for row in batch.to_pylist():
                        sample = {k: v for k, v in row.items() if v is not None}
                        if "__key__" not in row:
                            sample["__key__"] = f"{task:06d}-{rows:09d}"
                        writer.write(sample)
                        rows += 1
            writer.close()
        except BaseException:
            writer.abort()
            raise
        shards = json.loads(writer.manifest_json)["shards"]
        return {"task": task, "samples": rows, "shards": shards}

    def on_write_complete(self, write_result: Any) -> None:
        """Writes the merged manifest and removes what no successful task wrote."""
        results = sorted(write_result.write_returns, key=lambda r: r["task"])
        tasks = [r["task"] for r in results]
        if len(set(tasks)) != len(tasks):
            raise _core.ShardWriteError(
                f"{self.manifest_url}: write tasks {tasks} reported the same task twice"
            )
        entries = [entry for r in results for entry in r["shards"]]
        written = {os.path.basename(e["url"]) for e in entries}
        strays = [
            url
            for url in _listing(self.path, self.s3)
            if os.path.basename(url) not in written and self._ours(os.path.basename(url))
        ]
        if not _is_remote(self.path):
            directory = _local(self.path)
            for url in strays:
                os.remove(os.path.join(directory, os.path.basename(url)))
            for name in os.listdir(directory):
                # What a killed attempt's writer left: `.{shard name}.{pid}.{n}.partial`.
                if name.startswith(f".{self.prefix}-") and name.endswith(".partial"):
                    os.remove(os.path.join(directory, name))
        write_manifest(self.manifest_url, entries, s3=self.s3)
        if strays and _is_remote(self.path):
            raise _core.ShardWriteError(
                f"{strays[0]}: {len(strays)} shards under {self.path} were written by an "
                "attempt of a write task that its retry did not write again (the task's rows "
                f"changed between attempts); the manifest lists the {len(entries)} shards "
                "the successful attempts wrote: delete the others"
            )


def _cli_s3(s3: S3Config | None) -> list[str]:
    """The command line's ``--s3-*`` options for ``s3``."""
    if s3 is None:
        return []
    flags = []
    if s3.region is not None:
        flags += ["--s3-region", s3.region]
    if s3.endpoint_url is not None:
        flags += ["--s3-endpoint-url", s3.endpoint_url]
    if s3.profile is not None:
        flags += ["--s3-profile", s3.profile]
    if s3.path_style:
        flags.append("--s3-path-style")
    if s3.unsigned:
        flags.append("--s3-unsigned")
    return flags


def _literal(url: str) -> str:
    """``url`` as a spec that names it and nothing else: a listed name such
    as ``b{1,2}.tar`` is not a brace pattern, so its braces are escaped
    (``b\\{1,2\\}.tar``), as dataset specs take them."""
    return url.replace("{", "\\{").replace("}", "\\}")


def _index_slice(urls: list[str], output: str, flags: list[str], task: int) -> list[Any]:
    """Runs ``shardstream index`` over ``urls`` (taken as they are, not as
    patterns); their manifest entries, in order.

    A local ``output``'s part is written beside it, so that the entries'
    URLs are relative to its directory as the one-machine index makes them."""
    if _is_remote(output):
        scratch = tempfile.mkdtemp(prefix="shardstream-index-")
        part = os.path.join(scratch, MANIFEST)
    else:
        scratch = None
        directory, name = os.path.split(os.path.abspath(_local(output)))
        part = os.path.join(directory, f".{name}.task-{task:06d}.{os.getpid()}.json")
    specs = [_literal(url) for url in urls]
    command = [sys.executable, "-m", "shardstream", "index", *flags, *specs, "-o", part]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise _core.ShardStreamError(
                f"shardstream index of {len(urls)} shards ({urls[0]}, ...) failed: "
                + (done.stderr.strip() or f"exit status {done.returncode}")
            )
        with open(part, encoding="utf-8") as f:
            return list(json.load(f)["shards"])
    finally:
        # The part, and the journal of an index that stopped before it.
        for leftover in (part, part + ".partial"):
            if os.path.exists(leftover):
                os.remove(leftover)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def index(
    spec: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    num_tasks: int | None = None,
    s3: S3Config | Mapping[str, Any] | None = None,
    format: Literal["tar", "jsonl"] = "tar",
) -> str:
    """``shardstream index spec -o output`` with the shards read by Ray tasks.

    The driver resolves ``spec`` once (as ``shardstream index`` does); its
    shards are cut into ``num_tasks`` runs in order (default: the cluster's
    CPUs), each indexed by one task running ``shardstream index``, and the
    entries are written to ``output`` (a path or ``s3://`` URL) as one
    manifest, the same as the one-machine ``shardstream index`` writes.
    ``s3`` gives the tasks' ``--s3-*`` options (region, endpoint, profile,
    path style, unsigned); credentials come from each worker's environment.
    ``format`` is ``shardstream index --format``: tar or JSON-lines shards.
    Returns ``output``.
    """
    specs = [spec] if isinstance(spec, str | os.PathLike) else list(spec)
    if not specs:
        raise ValueError("spec: no dataset spec given")
    if isinstance(s3, Mapping):
        s3 = S3Config(**s3)
    if num_tasks is not None and (
        isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1
    ):
        raise ValueError(f"num_tasks must be an int of at least 1, got {num_tasks!r}")
    if format not in ("tar", "jsonl"):
        raise ValueError(f'format must be "tar" or "jsonl", got {format!r}')
    output = os.fspath(output)
    options = _core.Options(format=format, manifest=False, s3=s3)
    urls = _core.ShardList([os.fspath(s) for s in specs], options).urls
    if num_tasks is None:
        num_tasks = max(1, int(ray.cluster_resources().get("CPU", 1)))
    num_tasks = min(num_tasks, len(urls))
    flags = [*_cli_s3(s3), "--format", format]
    run = ray.remote(_index_slice)
    bounds = [len(urls) * t // num_tasks for t in range(num_tasks + 1)]
    parts = [
        run.remote(urls[bounds[t] : bounds[t + 1]], output, flags, t) for t in range(num_tasks)
    ]
    entries = [entry for part in ray.get(parts) for entry in part]
    write_manifest(output, entries, s3=s3)
    return output

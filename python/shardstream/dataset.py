"""``StreamingDataset``: a torch ``IterableDataset`` over tar shards, Parquet files
and raw objects."""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate_fn_map

from ._core import (
    Counters,
    DecodeFieldWarning,
    Options,
    SampleSkippedWarning,
    SampleStream,
    ShardList,
    StateMismatchError,
    TransformError,
    check_layout,
    check_state,
    raise_malloc_thresholds,
)
from .epochs import EpochAdvance
from .job_resolution import resolve_once
from .local_bytes import LocalBytes
from .resplit import check_not_resplit, find_splitter
from .shared_bytes import SHARED_MEMORY_AVAILABLE, SharedBytes
from .shared_bytes import configure as configure_shared_bytes
from .state import elastic_slots
from .telemetry import exposition, window
from .worker_sharing import check_worker_start

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import DatasetOptions

__all__ = ["Batch", "StreamingDataset"]


class SkipLog(Protocol):
    """Where a dataset's streams record what ``on_error="warn"`` leaves out,
    and with ``pack`` the documents with no tokens no sequence carries
    (``shardstream.ledger.SkipLog`` is one)."""

    def __call__(
        self, epoch: int, shard: int, first: int, end: int | None, reason: str, cause: str
    ) -> None:
        """Samples ``first..end`` of ``shard`` in ``epoch`` (``end``
        ``None``: to the shard's end) were left out, for ``reason``;
        ``cause`` is ``"error"`` or ``"no_tokens"``."""

    def samples(self, ids: Any, reason: str) -> None:
        """The samples ``ids`` (an item's ``__id__``) were left out."""


class StreamingDataset(IterableDataset[Any]):
    """Streams samples from WebDataset tar shards, Parquet files or raw
    objects, split across ranks and DataLoader workers before any byte is read.

    Each sample is a dict: ``__key__`` (str), ``__url__`` (the shard, str) and
    one value per field: for a tar shard the member's extension, lower-cased,
    with its ``bytes``; for a Parquet row, each column's value; for a raw
    object, its body under its extension (``bytes`` when it has none).

    Args:
        urls: a path, ``file://``, ``s3://``, ``http(s)://`` or
            ``hf://datasets/ORG/NAME[@REVISION]/PATH`` URL, brace pattern
            (``data/shard-{000000..000127}.tar``) or directory (its ``*.tar``,
            ``*.tar.gz``, ``*.tgz`` and ``*.tar.zst`` files, sorted), or a list
            of them. gzip and zstd shards are decoded as they stream, told by
            their first bytes.
        seed: seed of the shard order and the shuffle buffer.
        shuffle_shards: shuffle the shard order every epoch.
        shuffle_buffer: shuffle buffer size in samples; 0 disables it.
        shuffle_buffer_bytes: byte budget of the shuffle buffer.
        shuffle_initial: samples the shuffle buffer holds before the first one
            leaves; it then grows by one sample per sample out until it holds
            ``shuffle_buffer``, so an epoch starts without waiting for a full
            buffer. Set it to ``shuffle_buffer`` to fill the buffer first.
        read_ahead_bytes: bytes each worker reads ahead of its parser; ``None``
            (the default): 64 MiB where one process reads (``num_workers`` 0 or
            1), else 32 MiB each.
        rank, world_size: this process's place in the job; ``None`` takes them
            from ``torch.distributed`` when initialised, else from the
            ``RANK``/``WORLD_SIZE`` environment variables, else 0 and 1.
        num_workers, worker_id: override the DataLoader worker info (mostly
            for tests and custom launchers). ``num_workers`` without
            ``worker_id`` must be the count of the DataLoader that iterates
            the dataset (a ``ValueError`` as the iteration begins otherwise:
            it would read one worker's share only).
        on_error: ``"raise"`` ends the epoch with the error; ``"warn"`` skips
            the rest of a bad shard with a ``ShardSkippedWarning`` and counts it.
        io_timeout: seconds to wait for the next bytes of a shard.
        manifest: a manifest written by ``shardstream index``; ``None`` uses
            the ``manifest.json`` beside the shards if there is one, ``False``
            uses none. With a manifest every rank gets the same number of
            samples and ``len()`` works.
        remainder: with a manifest, ``"drop"`` leaves out the last
            ``total % world_size`` samples of the epoch, ``"pad"`` fills the
            last rank up with the epoch's first samples.
        s3: how to reach ``s3://`` shards (``shardstream.S3Config`` or a dict
            of its fields); the client is made in each DataLoader worker.
            Its timeouts, retries, part size and concurrency apply to
            ``http(s)://`` and Hub shards too.
        http_headers: headers of every ``http(s)://`` request (a dict of
            str to str, e.g. ``{"Authorization": "Bearer ..."}``), sent to
            the shard's own host only, never shown in a repr or an error.
        format: ``"auto"`` (Parquet for ``*.parquet`` names, JSON lines for
            ``*.jsonl``, ``.jsonl.gz`` and ``.jsonl.zst`` names given, tar
            otherwise; directories and prefixes list tar and Parquet names),
            ``"tar"``, ``"parquet"`` (each row group is a unit of the plan,
            each row a sample), ``"raw"`` (every file or object is one
            sample; directories and prefixes are listed recursively) or
            ``"jsonl"`` (each line a sample, its JSON object's keys the
            fields; directories and prefixes list JSON-lines names).
        decode: field decoders run in Rust threads with the GIL released:
            ``True`` for the defaults by extension (``json``; ``txt``: str;
            ``cls``: int; ``npy``: numpy; ``wav``, ``flac``: audio as a float32
            ``(frames, channels)`` array and the sample rate; ``jpg``,
            ``jpeg``, ``png``: rgb8 uint8 ``(H, W, 3)`` array), or a dict of
            field name to decoder name. A field that fails to decode raises
            ``FieldDecodeError`` naming the shard, key and field.
        decode_threads: threads that run the field decoders and transforms
            of each stream (GIL released). ``None``: the cores this process
            may use, shared among its DataLoader workers (and among
            torchrun's processes on the node, ``LOCAL_WORLD_SIZE``), 1 to 16.
            The samples do not depend on it.
        columns: Parquet columns to read (all by default).
        batch_format: ``"dict"`` (samples, or collated batches) or
            ``"arrow"`` (Parquet only: ``pyarrow.RecordBatch`` objects handed
            over zero-copy, rows in file order, so ``shuffle_buffer`` must be 0).
        batch_size: hand out batches of this many samples, collated in Rust
            (numpy arrays for equal-shape arrays and numbers, lists
            otherwise); use ``DataLoader(batch_size=None)`` with it. The
            last batch of each worker may be smaller.
        pack: a ``shardstream.Pack``: each document's token ids laid into
            fixed-length sequences, handed out instead of the documents
            (``input_ids``, ``position_ids``, ``cu_seqlens``; see
            docs/text.md; with ``sample_ids``, each sequence's ``__id__``
            rows name the documents that end in it). One rank only;
            ``len()`` is not defined.
        pack_bytes: with ``batch_size``, a bytes field that every sample of
            the batch has becomes one ``uint8`` array of its members end to
            end, plus ``<field>_offsets`` (``int64``, one more than the
            batch's samples: member ``i`` is ``data[offsets[i]:offsets[i +
            1]]``), instead of a list of ``bytes``: one object per field
            instead of one per sample, ready for ``torch.from_numpy`` and
            batched GPU decoders.
        local_bytes_by_reference: in DataLoader workers, hand out members of
            16 KiB or more of local (memory-mapped) tar shards as
            ``shardstream.local_bytes.LocalBytes``, a ``bytes`` that pickles
            as its place in the shard: the main process reads it from the
            file (page cache) instead of receiving it through the worker's
            pipe, and gets plain ``bytes``. Shards must not change while
            they are read (a changed one raises ``ObjectChangedError``).
            ``False`` hands them over as other members are (see
            ``worker_shared_memory_bytes``).
        worker_shared_memory_bytes: in DataLoader workers, hand out the
            other members of 16 KiB or more (of S3, HTTP(S), Hub, GCS,
            compressed and cached shards, and of local ones not handed out
            by reference) as
            ``shardstream.shared_bytes.SharedBytes``, a ``bytes`` that
            pickles as its place in a shared-memory segment (``/dev/shm``)
            the worker writes it to: the main process reads it from there
            instead of receiving it through the worker's pipe, and gets plain
            ``bytes``. At most this many bytes of segments are alive per
            worker (64 MiB by default); members past the bound, or when
            ``/dev/shm`` is full, go through the pipe. Segments are removed
            as the main process opens them, when a worker exits, when the
            main process sees a worker is gone, and at its exit. ``0`` sends
            them through the pipe.
        raise_malloc_thresholds: raise glibc's malloc thresholds (mmap
            32 MiB, trim 64 MiB: where glibc's own adaptive rule puts them
            after a 32 MiB block is freed) in each process that iterates
            the dataset (a DataLoader worker, the main process with
            ``num_workers=0``), and, with ``local_bytes_by_reference`` or
            ``worker_shared_memory_bytes``, in the main process on its
            first read of a reference, so that each batch reuses the heap
            the previous one freed instead of faulting fresh pages in.
            Process-wide, glibc only. ``False`` leaves the allocator as it is.
        read_next_epoch_early: in a DataLoader worker made with
            ``persistent_workers=True``, open the worker's next epoch's
            stream when its epoch ends and start reading it, so that its
            first batches are ready when the next iteration asks (while the
            training loop evaluates or checkpoints, the worker's read-ahead
            budget and first samples are held). The same in a process that
            is no worker (the main process with ``num_workers=0``,
            torchdata.nodes) once it has begun a second iteration of the
            dataset: from the end of that one on (a single pass starts
            nothing). The iteration takes it only if it is the stream it
            would open (``set_epoch`` to another epoch or a loaded state
            drop it). In a ``Mix``, each stream whose dataset has it and of
            which the next epoch's mixture takes samples starts its next
            epoch when the mixture's epoch ends. ``False`` opens each
            epoch's stream at its iteration.
        count_samples: count the samples of local plain tar shards that no
            manifest describes from their headers, when the dataset is made:
            ``None`` when ``world_size > 1``, ``True`` always (then ``len()``
            works on one rank too; remote shards without a manifest are read
            through once at start-up, spread over the ranks), ``False`` never
            (shards are then dealt whole, balanced by bytes; one rank only).
        transform: a function applied to each item the dataset yields, in
            the process that iterates (the DataLoader worker): to each
            sample, or, with ``batch_size`` or ``batch_format="arrow"``, to
            each batch, after Rust collation. Its result is what the
            iteration yields. An exception in it raises ``TransformError``
            naming the shard and key (the exception as its ``__cause__``);
            with ``on_error="warn"`` the item is skipped instead, with a
            ``SampleSkippedWarning``, and counted in ``errors_skipped``.
            DataLoader workers started with ``spawn`` or ``forkserver``
            need it picklable (a module-level function, not a lambda).
        sample_seed: give each sample an ``int`` field ``__seed__``, drawn
            in Rust from the sample's identity (``seed``, the epoch, the
            shard's index in the shard list and the sample's index in the
            shard) and nothing else, for ``transform`` to draw its
            randomness from (``shardstream.sample_generator(sample)``,
            ``shardstream.sample_rng(sample)``): a sample is then
            transformed the same way with any rank or worker count, after
            an exact or elastic resume, and in a ``Mix``. In a Rust batch
            it is an ``int64`` column. Resume states do not depend on it.
        sample_ids: give each sample a field ``__id__``, the tuple
            ``(epoch, shard index, index in shard)`` of ints that
            ``shardstream.Ledger`` records and ``shardstream verify``
            checks. DataLoader's default collate makes it a list of 3
            ``int64`` tensors; a Rust batch an ``int64`` array of shape
            ``(batch_size, 3)``. Resume states do not depend on it.
        model_parallel_size: ranks per model-parallel (tensor or context
            parallel) group: ranks ``g * size`` to ``(g + 1) * size - 1``
            form data-parallel rank ``g`` of ``world_size // size``, and
            receive the same samples in the same order; each sample is read
            once per data-parallel group. ``world_size`` must be a multiple.
        cache_dir: a directory where remote shards (S3, HTTP(S), the Hub)
            are kept as they stream, so that later epochs, and every rank
            and worker of the node, read the local copy (see docs/sources.md).
            Made if missing; one that cannot be written is refused at once.
        cache_limit_bytes: the most bytes the cache keeps, least recently
            used shards evicted first (never one being read); a shard
            larger than the limit is streamed, not cached. None: no limit.
    """

    def __init__(
        self,
        urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int | None = None,
        worker_id: int | None = None,
        **options: Unpack[DatasetOptions],
    ) -> None:
        super().__init__()
        if isinstance(urls, (str, os.PathLike)):
            specs = [os.fspath(urls)]
        elif isinstance(urls, Sequence) and all(isinstance(u, (str, os.PathLike)) for u in urls):
            specs = [os.fspath(u) for u in urls]
        else:
            raise TypeError(
                "urls must be a path, URL or brace pattern, or a list of them, "
                f"got {type(urls).__name__}"
            )
        # Every part of the layout checked once, in Rust.
        check_layout(world_size=world_size, num_workers=num_workers, rank=rank, worker_id=worker_id)
        manifest = options.get("manifest")
        if isinstance(manifest, os.PathLike):
            options["manifest"] = os.fspath(manifest)
        # Every option is parsed and checked here, in Rust, once.
        self.options = Options(**options)
        self.rank = rank
        self.world_size = world_size
        self.num_workers = num_workers
        self.worker_id = worker_id
        _, resolved_world = self.distributed_slot()

        def resolve() -> ShardList:
            shard_list = ShardList(specs, self.options)
            count_for_ranks(shard_list, resolved_world)
            return shard_list

        # Listed, footers and manifest read, counted: once per job.
        self.shard_list = resolve_once(specs, self.options, resolve, resolved_world > 1)
        self.shard_list.check_equal_length(resolved_world)
        self._epochs: EpochAdvance[str] = EpochAdvance()
        self._counters = Counters()
        self._stats_since: dict[str, int] | None = None
        self._stream: SampleStream | None = None
        # The shards a loaded state's epoch is planned over, when they are
        # counted for it alone (``load_state_dict``).
        self._resume_shards: ShardList | None = None
        # The epoch ``set_epoch`` set while the stream of it was read: the
        # next iteration's if that stream is left before its end.
        self._again: int | None = None
        # The next epoch's stream, started in a persistent DataLoader worker
        # when this epoch's ended, with the process that started it (see
        # ``_start_next``).
        self._next_stream: tuple[int, SampleStream] | None = None
        self._decode_checked = False
        self.skip_log: SkipLog | None = None
        """Where this dataset's streams record the samples they leave out
        under ``on_error="warn"`` (a ``Ledger`` sets it): DataLoader
        workers made after it is set record there too."""

    @property
    def shards(self) -> list[tuple[str, int | None]]:
        """The shards as ``(url, size in bytes or None)``, in listed order."""
        return list(zip(self.shard_list.urls, self.shard_list.sizes, strict=True))

    @property
    def manifest_path(self) -> str | None:
        """The manifest in use, if any."""
        path = self.shard_list.manifest_path
        return None if path is None else os.fspath(path)

    @property
    def epoch(self) -> int:
        """The epoch of this process's next iteration (in a DataLoader
        worker, of that worker's). Setting it is ``set_epoch``."""
        return self._epochs.next

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch of the next iteration; the shard order and shuffle
        follow ``(seed, epoch)``.

        Without it, each new iteration takes the epoch after the previous
        one (0 first), in the main process and in DataLoader workers alike,
        persistent or not, forked or started with ``spawn`` or
        ``forkserver``: a new ``iter(loader)`` never repeats an epoch. Call
        it before creating the epoch's DataLoader iterator; the iterations
        after that one go on from ``epoch + 1``. Calling it with another
        epoch than a pending resume's drops the resume. Calling it once the
        epoch's iterator exists in this process (as Lightning's epoch hooks,
        ``StatefulDataLoader`` and Accelerate do): with that iterator's epoch
        it changes nothing; with another, an iterator not read yet streams
        the new epoch, and one being read goes on (its state is still the
        one ``state_dict`` gives) while the next iteration takes the new
        epoch. If the next iteration begins before the iterator of
        ``epoch`` being read has ended (it was left early, a ``break``), it
        streams ``epoch`` from its start, as DataLoader workers do
        (Accelerate sets the epoch it counts again after such a pass).
        """
        self._again = None
        stream = self._stream
        if stream is None or json.loads(stream.state())["finished"]:
            if self._epochs.set(epoch):
                self._stream = None
            return
        if stream.started or epoch == stream.epoch:
            # The stream being read stays the one a state describes (and
            # the next iteration's epoch if it is left before its end).
            self._epochs.set(epoch, running=stream.epoch)
            self._again = epoch if epoch == stream.epoch else None
            return
        # An iterator made and not read yet (StatefulDataLoader makes one
        # to take its first state; Accelerate sets the epoch after that):
        # it streams the epoch set now.
        self._epochs.set(epoch)
        stream.retarget(self._open_stream(self.epoch))
        self._epochs.started(stream.epoch)

    def distributed_slot(self) -> tuple[int, int]:
        """``(rank, world_size)`` of the data: with ``model_parallel_size``
        of 1 the process's own, else its data-parallel group's (see
        ``process_slot`` and the option)."""
        rank, world_size = self.process_slot()
        group = int(self.options["model_parallel_size"])
        if world_size % group:
            raise ValueError(
                f"invalid option model_parallel_size: {group} does not divide "
                f"world_size {world_size}"
            )
        return rank // group, world_size // group

    def process_slot(self) -> tuple[int, int]:
        """``(rank, world_size)`` of this process: explicit arguments, else
        torch.distributed, else ``RANK``/``WORLD_SIZE``, else ``(0, 1)``."""
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

    def check_worker_count(self) -> None:
        """Raises ``ValueError`` as an iteration begins when ``num_workers``
        was given without ``worker_id`` and the process iterating is not
        one of that many DataLoader workers: it would read one worker's
        share of the rank's samples, the rest left out without a word."""
        if self.num_workers is None or self.worker_id is not None:
            return
        info = get_worker_info()
        actual = info.num_workers if info is not None else 1
        if actual != self.num_workers:
            where = (
                f"a DataLoader of {actual} workers"
                if info is not None
                else "a process that is no DataLoader worker"
            )
            raise ValueError(
                f"invalid option num_workers: {self.num_workers} was given, but {where} "
                f"iterates the dataset, which would read worker {info.id if info else 0}'s "
                f"share of {self.num_workers} only: leave num_workers out (a DataLoader's "
                "own count is found), or give worker_id too"
            )

    def num_samples(self) -> int:
        """Samples per rank per epoch; needs sample counts: a manifest for
        tar shards (Parquet footers and raw objects give them). With ``pack``
        on several ranks it is not defined: the plan cuts the ranks equal
        tokens, so their documents differ in number."""
        _, world_size = self.distributed_slot()
        if self.options["pack"] is not None and world_size > 1:
            raise TypeError(
                "num_samples() is not defined with pack on several ranks: the plan cuts each "
                "rank equal tokens, not equal documents (every rank hands out the same number "
                "of sequences)"
            )
        n = self.shard_list.samples_per_rank(world_size, self.options["remainder"])
        if n is None:
            raise TypeError(
                "len() needs every shard's sample count, and these shards have none: "
                "count_samples=True counts them when the dataset is made (local tar headers "
                "at once; other shards read through once, spread over the ranks), or give "
                "a manifest: the manifest.json that ShardWriter writes beside its shards is "
                "found there (manifest=URL names one elsewhere), and `shardstream index "
                "SPEC -o DIR/manifest.json` writes one for any shards"
            )
        return n

    def __len__(self) -> int:
        """Samples per rank per epoch (see ``num_samples``). Not defined when
        batches are handed out: their number depends on how the DataLoader's
        workers split the rank's samples.

        Asked by ``len(loader)`` of a DataLoader whose workers would yield
        another number of batches than ``len(loader)`` says (each worker
        yields its own last, partial batch), it raises ``TypeError`` naming
        the fix: frameworks that end an epoch after ``len(loader)`` batches
        would otherwise leave samples out, or wait for batches that never
        come."""
        if self.options.batches:
            raise TypeError(
                "len() is not defined for batches (their number depends on the DataLoader's "
                "workers); num_samples() gives the samples per rank"
            )
        if self.options["pack"] is not None:
            raise TypeError(
                "len() is not defined with pack (the number of sequences depends on the "
                "documents' token counts); on one rank num_samples() gives the documents"
            )
        n = self.num_samples()
        check_loader_length(sys._getframe(1), self, n)
        return n

    def __iter__(self) -> Iterator[Any]:
        return in_worker_raising_at_next(self._iterate, self._epochs)

    def _iterate(self) -> Iterator[Any]:
        """``__iter__``'s iterator, what stops it raised here."""
        # Accelerate's wrappers would split this rank's part between ranks again.
        check_not_resplit(self, self.distributed_slot()[1])
        self.check_worker_count()
        # The pending resume is used up here, not lazily: StatefulDataLoader
        # may create and discard an iterator.
        if self.options["raise_malloc_thresholds"]:
            # The process that iterates makes each sample's ``bytes``.
            raise_malloc_thresholds()
        again, self._again = self._again, None
        left = self._stream
        if again is not None and left is not None and not json.loads(left.state())["finished"]:
            # The stream of the epoch set last was left before its end.
            self._epochs.set(again)
        stream = self._started_next()
        if stream is None:
            early = self.options["read_next_epoch_early"] and goes_on_to_next_epoch(self._epochs)
            stream = self._open_stream(self.epoch, start_next_of(self) if early else None)
        # A resumed stream takes its epoch from the state; either way the
        # next iteration streams the epoch after this one.
        self._epochs.started(stream.epoch)
        self._stream = stream
        items: Iterator[Any] = stream
        batches = self.options["batch_size"] is not None and self.options["batch_format"] == "dict"
        check = not self._decode_checked and isinstance(self.options["decode"], Mapping)
        if batches or check:
            items = _handed_out(stream, self, batches)
        transform = self.options["transform"]
        if transform is None:
            return items
        skip = self.options["on_error"] == "warn"
        return _Transformed(items, transform, skip, self._counters, self.skip_log)

    def check_decode_fields(self, item: Any) -> None:
        """Warns with a ``DecodeFieldWarning`` if a key of the ``decode``
        dict names no field of ``item`` (the first sample or batch this
        process takes from the dataset): such a key decodes nothing. Once
        per dataset and process; ``shardstream.Mix`` calls it for its
        streams."""
        if self._decode_checked:
            return
        self._decode_checked = True
        decode = self.options["decode"]
        # Packed sequences hold token ids, not the decoded fields (a field
        # that is not there fails the packing, naming it).
        if not isinstance(decode, Mapping) or self.options["pack"] is not None:
            return
        if isinstance(item, Mapping):
            fields = [f for f in item if not (f.startswith("__") and f.endswith("__"))]
            url = item.get("__url__")
            where = f" (shard {url[0] if isinstance(url, list) and url else url})" if url else ""
        elif hasattr(item, "schema"):
            fields, where = list(item.schema.names), ""
        else:
            return
        unused = [key for key in decode if key not in fields]
        if unused:
            names = ", ".join(repr(key) for key in unused)
            have = ", ".join(repr(f) for f in fields) or "none"
            warnings.warn(
                f"decode key {names} matches no field of the first sample{where}, whose "
                f"fields are {have}: it decodes nothing (a tar member's field is its name "
                "after the first dot, lower-cased: 'jpg' for 'x.jpg'; a Parquet field is "
                "a column)",
                DecodeFieldWarning,
                stacklevel=3,
            )

    def state_dict(self) -> dict[str, Any]:
        """The state of this process's stream as of the last sample it handed
        out (a new dict each call). With ``StatefulDataLoader`` each worker
        reports its own; see ``load_state_dict``. In a DataLoader's main
        process once its workers began iterating (and no ``set_epoch`` or
        ``load_state_dict`` came since), a ``StateMismatchError``: the
        workers' progress is not known there."""
        self._epochs.check_state_known("StreamingDataset")
        stream = self._stream if self._stream is not None else self._open_stream(self.epoch)
        state: dict[str, Any] = json.loads(stream.state())
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resumes from a state at the next ``__iter__``.

        ``state_dict`` is either one slot's state (what ``state_dict()``
        returned, restored by ``StatefulDataLoader`` with the same world size
        and ``num_workers``: the rest of the epoch comes in exactly the
        uninterrupted order), or ``shardstream.elastic_state(...)`` of every
        slot of a job (any new world size and ``num_workers``: every sample
        not yet produced comes once). The next iteration streams the rest
        of the state's epoch, and the one after it the epoch after the
        state's. A state saved once its epoch was finished leaves nothing
        for the next iteration (``epoch`` then already reads the state's
        epoch + 1). A malformed state raises ``StateMismatchError`` here, a
        state of other data or options when iteration starts.
        """
        if not isinstance(state_dict, Mapping):
            raise StateMismatchError(
                "not a shardstream.StreamingDataset state: expected a dict, got "
                f"{type(state_dict).__name__}"
            )
        slots = elastic_slots(state_dict)
        elastic = slots is not None
        try:
            resume = json.dumps(slots if elastic else dict(state_dict))
        except (TypeError, ValueError) as error:
            raise StateMismatchError(
                f"not a shardstream.StreamingDataset state: not JSON data ({error})"
            ) from None
        check_state(resume)
        parsed = json.loads(resume)
        slots = parsed if isinstance(parsed, list) else [parsed]
        if not elastic:
            check_worker_count(parsed, self.num_workers)
        epoch = int(slots[0]["epoch"])
        # Saved by several ranks (or in an epoch resumed from such states),
        # so planned over counted shards: the resumed epoch is planned over
        # a counted copy here too, whatever this job's world size. Saved by
        # one rank, the state's epoch is planned as it was (counted or not),
        # and a counted copy lets every field be checked against the
        # samples its cursor passed (and an elastic resume cut them): local
        # tar shards are counted (nothing remote is read: a manifest beside
        # remote shards would give them sizes the state's fingerprint did
        # not have), under on_error="raise" (under "warn" a
        # shard skipped uncounted left out samples the state did not
        # count). Later epochs are this dataset's own, as a fresh one plans
        # them.
        self._resume_shards = None
        saved_world = saved_world_size(slots)
        if saved_world > 1 and not self.shard_list.counted:
            self._resume_shards = copy.copy(self.shard_list)
            count_for_ranks(self._resume_shards, saved_world)
        elif self.options["on_error"] == "raise" and self.options["pack"] is None:
            self._resume_shards = self.shard_list.counted_locally()
        self._stream = self._again = None
        self._epochs.load(resume, epoch, all(slot["finished"] for slot in slots))

    def _open_stream(self, epoch: int, on_end: Callable[[], None] | None = None) -> SampleStream:
        """This slot's stream for ``epoch`` (or the pending resume); its
        threads start at the first ``next()``. ``on_end`` is called when
        the stream ends."""
        rank, world_size = self.distributed_slot()
        worker_id, num_workers = self.worker_slot()
        # torch.distributed may have been set up after construction.
        count_for_ranks(self.shard_list, world_size)
        return self.slot_stream(
            epoch,
            self._epochs.pending(),
            (rank, world_size, worker_id, num_workers),
            on_end=on_end,
        )

    def _start_next(self) -> None:
        """Called when an epoch's stream ends in a process that goes on to
        the next epoch (``read_next_epoch_early``, ``goes_on_to_next_epoch``):
        opens the next epoch's stream and starts its reads, so that they run
        while the other workers and the training loop finish the epoch. The
        next ``__iter__`` takes it if it is still the stream that iteration
        would open (``_started_next``).
        A stream that cannot be opened or started now is opened again by
        that iteration, which raises what stops it."""
        self._next_stream = None
        try:
            if self._epochs.pending() is not None:
                return
            stream = self._open_stream(self.epoch, start_next_of(self))
            if stream.start():
                self._next_stream = (os.getpid(), stream)
        except Exception:
            return

    def _started_next(self) -> SampleStream | None:
        """The stream ``_start_next`` started, if the next iteration would
        open the same: in this process, its epoch still the next
        (``set_epoch`` and a loaded state change it) and this process's slot
        the same. Either way it is no longer kept."""
        started, self._next_stream = self._next_stream, None
        if started is None:
            return None
        pid, stream = started
        if pid != os.getpid() or self._epochs.pending() is not None or stream.epoch != self.epoch:
            return None
        rank, world_size = self.distributed_slot()
        worker_id, num_workers = self.worker_slot()
        state = json.loads(stream.state())
        slot = (state["rank"], state["world_size"], state["worker_id"], state["num_workers"])
        return stream if slot == (rank, world_size, worker_id, num_workers) else None

    def slot_stream(
        self,
        epoch: int,
        resume: str | None,
        slot: tuple[int, int, int, int],
        plan_sequences: bool = False,
        on_end: Callable[[], None] | None = None,
    ) -> SampleStream:
        """The stream of ``slot`` (``(rank, world_size, worker_id,
        num_workers)``) for ``epoch``, or for ``resume`` (a state's JSON),
        counting in this dataset's counters; its threads start at the first
        ``next()``. ``shardstream.Mix`` opens its streams with it, with
        ``plan_sequences`` (with ``pack``, the sequences planned from the
        token counts on one rank too). ``on_end`` is called when the stream
        ends."""
        rank, world_size, worker_id, num_workers = slot
        in_worker = get_worker_info() is not None
        raise_thresholds = self.options["raise_malloc_thresholds"]
        shared_limit = self.options["worker_shared_memory_bytes"] if in_worker else 0
        shared_limit = shared_limit if SHARED_MEMORY_AVAILABLE else 0
        if shared_limit:
            configure_shared_bytes(shared_limit, raise_thresholds, self._main_process())
        resumed_shards = self._resume_shards if resume is not None else None
        return SampleStream(
            self.shard_list if resumed_shards is None else resumed_shards,
            epoch=epoch,
            world_size=world_size,
            rank=rank,
            num_workers=num_workers,
            worker_id=worker_id,
            resume=resume,
            counters=self._counters,
            local_bytes=(
                functools.partial(LocalBytes, raise_malloc_thresholds=raise_thresholds)
                if self.options["local_bytes_by_reference"] and in_worker
                else None
            ),
            shared_bytes=SharedBytes if shared_limit else None,
            on_skip=self.skip_log,
            plan_sequences=plan_sequences,
            on_end=on_end,
        )

    def stats(self, reset: bool = False) -> dict[str, int]:
        """Counters over every epoch iterated so far: ``shards_opened``,
        ``shards_completed``, ``samples``, ``bytes_read`` (from storage),
        ``errors_skipped``, ``requests``, ``retries``, ``resumed_bodies``,
        ``read_ahead_peak_bytes``, ``cache_hits`` and ``cache_bytes`` (reads of
        ``cache_dir`` copies); the time per stage in nanoseconds
        (``storage_wait_ns``, ``parse_ns``, ``decode_ns``, ``transform_ns``,
        ``handoff_ns``, ``output_wait_ns``, ``next_wait_ns``, with
        ``pipeline_ns`` and ``decode_busy_ns``); bytes per stage
        (``parsed_bytes``, ``decoded_bytes``); and the queues' levels
        (``read_ahead_bytes``, ``output_queue_samples``). docs/telemetry.md
        says what each one measures.

        With ``reset=True``: the counters since the last reset (levels as
        they are now), and a new window starts.

        DataLoader workers add to the same counters, whether forked from this
        process or started with ``spawn`` or ``forkserver`` (the counters'
        shared memory is handed to them).
        """
        now = self._counters.snapshot()
        stats = window(now, self._stats_since)
        if reset:
            self._stats_since = now
        return stats

    def stats_text(self, reset: bool = False) -> str:
        """``stats(reset)`` in the Prometheus text exposition format
        (``shardstream_samples_total``, ``shardstream_stage_seconds_total{stage="parse"}``,
        ...), for a metrics endpoint or a textfile collector."""
        return exposition([({}, self.stats(reset))])

    def __getstate__(self) -> dict[str, Any]:
        check_worker_start()
        transform = self.options["transform"]
        if transform is not None:
            # A lambda would otherwise fail deep in the pickler, naming no option.
            try:
                ForkingPickler.dumps(transform)
            except Exception as error:
                raise TypeError(
                    f"invalid option transform: {transform!r} cannot be pickled, and DataLoader "
                    "workers started with spawn or forkserver (and any pickled copy of the "
                    "dataset) need it: define it at module level instead of as a lambda or a "
                    f"nested function ({type(error).__name__}: {error})"
                ) from error
        state = self.__dict__.copy()
        state["_stream"] = state["_next_stream"] = None
        # A DataLoader starting spawn or forkserver workers pickles the
        # dataset in its main process, which is then not the workers' parent.
        state["_pickled_by"] = os.getpid()
        # A spawned worker's stack holds no frame of a wrapper iterating
        # the loader in the main process: it is named here, while it does.
        state["_pickled_under"] = find_splitter(self)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._unpickled_in = os.getpid()

    def _main_process(self) -> int:
        """The process a DataLoader worker hands its batches to: the one that
        pickled the dataset for this worker (spawn, forkserver), else the
        worker's parent (fork)."""
        pickled_by = self.__dict__.get("_pickled_by")
        if pickled_by is not None and self.__dict__.get("_unpickled_in") == os.getpid():
            return int(pickled_by)
        return os.getppid()

    def __repr__(self) -> str:
        manifest = f", manifest={self.manifest_path!r}" if self.manifest_path else ""
        o = self.options
        return (
            f"StreamingDataset({len(self.shard_list)} shards{manifest}, seed={o['seed']}, "
            f"shuffle_shards={o['shuffle_shards']}, shuffle_buffer={o['shuffle_buffer']}, "
            f"epoch={self.epoch}, on_error={o['on_error']!r})"
        )


class _Transformed:
    """A slot's stream with the dataset's transform applied to each item.
    ``StreamingDataset.state_dict`` reads the stream itself, so a resume
    is as exact as without a transform. The transform's time is counted
    (``transform_ns``)."""

    __slots__ = ("_counters", "_skip", "_skip_log", "_stream", "_transform")

    def __init__(
        self,
        stream: Iterator[Any],
        transform: Callable[[Any], Any],
        skip: bool,
        counters: Counters,
        skip_log: SkipLog | None,
    ) -> None:
        self._stream = stream
        self._transform = transform
        self._skip = skip
        self._counters = counters
        self._skip_log = skip_log

    def __iter__(self) -> _Transformed:
        return self

    def __next__(self) -> Any:
        while True:
            taken = next(self._stream)
            started = time.perf_counter_ns()
            item = apply_transform(
                self._transform, taken, self._skip, self._counters, self._skip_log
            )
            self._counters.count_transform(time.perf_counter_ns() - started)
            if item is not SKIPPED:
                return item


def persistent_worker() -> bool:
    """Whether this call runs in a DataLoader worker (of torch's or
    ``StatefulDataLoader``'s) made with ``persistent_workers=True``: its
    worker loop's frame is on the stack. Such a worker iterates the dataset
    again at the next epoch; another one is stopped at the epoch's end.
    Found once per process (reading a frame's locals keeps a copy of them
    on the frame)."""
    if get_worker_info() is None:
        return False
    pid = os.getpid()
    if pid not in _PERSISTENT_WORKER:
        _PERSISTENT_WORKER[pid] = _worker_loop_persistent(sys._getframe(1))
    return _PERSISTENT_WORKER[pid]


# What ``persistent_worker`` found, by process id.
_PERSISTENT_WORKER: dict[int, bool] = {}


def _worker_loop_persistent(frame: FrameType | None) -> bool:
    """``persistent_workers`` of the DataLoader worker loop that called
    ``frame`` (False when none did)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_worker_loop" and "persistent_workers" in code.co_varnames:
            return bool(frame.f_locals.get("persistent_workers"))
        frame = frame.f_back
    return False


def goes_on_to_next_epoch(epochs: EpochAdvance[Any]) -> bool:
    """Whether this process is taken to iterate the dataset again once the
    iteration beginning now ends, so that its end may start the next
    epoch's reads (``read_next_epoch_early``): a DataLoader worker made with
    ``persistent_workers=True``, or a process that is no worker (the main
    process with ``num_workers=0``, torchdata.nodes) and has begun an
    iteration of the dataset before this one, as a loop over epochs does.
    A single pass starts nothing, and neither does a worker that stops at
    its epoch's end, nor a DataLoader2 or Grain worker. Called before
    ``epochs`` counts the iteration beginning now."""
    if get_worker_info() is not None:
        return persistent_worker()
    return epochs.worker_entry() is None and epochs.began_here()


def in_worker_raising_at_next(
    iterate: Callable[[], Iterator[Any]], epochs: EpochAdvance[Any]
) -> Iterator[Any]:
    """``iterate()``; in a DataLoader worker that has begun an iteration
    before (``epochs``), what it raises is raised by the iterator's first
    ``next()`` instead. A persistent worker makes each later epoch's
    iterator outside its error handling: an error raised there ends the
    worker ("exited unexpectedly", its message lost), while one raised by
    ``next()`` reaches the training loop as it is. A worker's first
    iterator is made inside it (``StatefulDataLoader`` reports what it
    raises as the workers start, before any batch is asked for)."""
    if get_worker_info() is None or not epochs.began_here():
        return iterate()
    try:
        return iterate()
    except Exception as error:
        return _RaisingAtNext(error)


class _RaisingAtNext:
    """An iterator whose ``next()`` raises the error it was given."""

    def __init__(self, error: Exception) -> None:
        self._error = error

    def __iter__(self) -> _RaisingAtNext:
        return self

    def __next__(self) -> Any:
        raise self._error


class StartsNext(Protocol):
    """A dataset that starts its next epoch's reads when an epoch ends
    (``StreamingDataset``, ``Mix``)."""

    def _start_next(self) -> None: ...


def start_next_of(owner: StartsNext) -> Callable[[], None]:
    """``owner._start_next``, holding ``owner`` weakly (the stream or
    iterator it is given to is the owner's own)."""
    ref = weakref.ref(owner)

    def start_next() -> None:
        live = ref()
        if live is not None:
            live._start_next()

    return start_next


def saved_world_size(slots: list[dict[str, Any]]) -> int:
    """The largest world size of ``slots`` (parsed slot states) and of the
    states each was resumed from."""
    largest = 1
    for slot in slots:
        largest = max(largest, int(slot["world_size"]))
        if slot.get("resumed_from"):
            largest = max(largest, saved_world_size(slot["resumed_from"]))
    return largest


def count_for_ranks(shard_list: ShardList, world_size: int) -> None:
    """Counts the samples of ``shard_list`` when ``world_size`` ranks read
    it: every rank must get the same number of samples, so local tar shards
    are counted now, or the job is refused now (a ``DatasetSpecError``
    naming ``shardstream index``), not with a hang at the epoch's end. The
    one place a layout asks for counts (a ``Mix`` always needs them)."""
    if world_size > 1:
        shard_list.count_samples()


def check_loader_length(caller: FrameType | None, dataset: IterableDataset[Any], n: int) -> None:
    """When ``caller`` (the frame that asked ``len(dataset)``) is a
    DataLoader's ``__len__`` over ``dataset``, whose ``n`` samples per rank
    its workers share: raises ``TypeError`` if the batches the workers
    yield differ from what ``len(loader)`` will say."""
    loader = caller.f_locals.get("self") if caller is not None else None
    if not isinstance(loader, DataLoader) or loader.dataset is not dataset:
        return
    batch, workers, drop_last = loader.batch_size, loader.num_workers, loader.drop_last
    if batch is None or workers <= 1:
        return
    per_batch = (lambda k: k // batch) if drop_last else (lambda k: math.ceil(k / batch))
    shares = [n // workers + (w < n % workers) for w in range(workers)]
    yielded = sum(per_batch(share) for share in shares)
    counted = per_batch(n)
    if yielded == counted:
        return
    fits = next(b for b in range(batch, 0, -1) if all(share % b == 0 for share in shares))
    example = f" (e.g. {fits})" if fits > 1 else ""
    effect = (
        f"a framework that ends the epoch after len(loader) batches would leave out "
        f"{yielded - counted} of them"
        if yielded > counted
        else f"the epoch would end with {counted - yielded} fewer than len(loader), the "
        "samples of each worker's partial batch dropped"
    )
    raise TypeError(
        f"len(loader) would be {counted}, but its {workers} workers yield {yielded} batches "
        f"of batch_size={batch}{' (drop_last)' if drop_last else ''}: each worker batches its "
        f"own share of the rank's {n} samples ({', '.join(map(str, sorted(set(shares))))}) "
        f"and yields its own last, partial batch; {effect}. Use a batch_size that divides "
        f"every worker's share{example}, num_workers=1 or 0, or leave len() out "
        "(Lightning and the HF Trainer then run the epoch to its end)"
    )


def check_worker_count(state: Mapping[str, Any], explicit: int | None) -> None:
    """In a DataLoader worker, without an explicit ``num_workers``: raises
    ``StateMismatchError`` if the slot state ``state`` was saved with another
    number of DataLoader workers (``StatefulDataLoader`` restores each
    worker's state in that worker, before it asserts on the count itself)."""
    info = get_worker_info()
    if info is None or explicit is not None:
        return
    saved = state.get("num_workers")
    if saved != info.num_workers:
        raise StateMismatchError(
            f"state field num_workers: the state was saved by worker {state.get('worker_id')} "
            f"of a DataLoader with num_workers={saved}, and this DataLoader has "
            f"num_workers={info.num_workers}: resume with num_workers={saved}, or load "
            "shardstream.elastic_state(...) of the saved states into the dataset (not the "
            "DataLoader) to resume with another num_workers"
        )


class Batch(dict[str, Any]):
    """A batch the dataset collated (``batch_size``, ``batch_format="dict"``):
    a dict of field to array or list, one entry per sample.

    ``DataLoader(dataset, batch_size=None)`` hands it over as it is. A
    DataLoader that batches again (its default ``batch_size=1``, or any
    other) would give ``(1, batch_size, ...)`` tensors: its default collate
    raises ``ValueError`` instead, naming the fix."""

    __slots__ = ()

    def __copy__(self) -> Batch:
        # What the DataLoader's default_convert and pin_memory call: as fast
        # as dict.copy, not through the generic reduce protocol.
        return Batch(self)


def _collate_batches(batch: Sequence[Batch], **_: Any) -> Any:
    """``default_collate`` of a list of ``Batch``: a mistake, said so."""
    keys = batch[0].get("__key__")
    size = f" of {len(keys)} samples" if isinstance(keys, list) else ""
    raise ValueError(
        f"the DataLoader batches again the batches{size} that shardstream already "
        f"collated (batch_size in the dataset), which would give tensors of shape "
        f"({len(batch)}, batch_size, ...): create it with DataLoader(dataset, "
        "batch_size=None), or give it a collate_fn of your own"
    )


# torch's documented extension point of default_collate.
default_collate_fn_map[Batch] = _collate_batches


def _handed_out(stream: SampleStream, dataset: StreamingDataset, batches: bool) -> Iterator[Any]:
    """The stream's items as the dataset hands them out: its collated
    batches as ``Batch``, the first item checked against ``decode``. Takes
    from the stream only the items it yields, so the stream's state stays
    that of the last item handed out."""
    for item in stream:
        dataset.check_decode_fields(item)
        yield Batch(item) if batches else item
        break
    if batches:
        for item in stream:
            yield Batch(item)
    else:
        yield from stream


SKIPPED = object()
"""What ``apply_transform`` returns for an item skipped under ``on_error="warn"``."""


def apply_transform(
    transform: Callable[[Any], Any],
    item: Any,
    skip: bool,
    counters: Counters,
    skip_log: SkipLog | None = None,
) -> Any:
    """``transform(item)``; an exception in it raises ``TransformError``
    naming the shard and key, or, with ``skip``, warns with a
    ``SampleSkippedWarning``, counts the item as skipped, records its
    ``__id__`` in ``skip_log`` (if any) and returns ``SKIPPED``."""
    # Named before the call: the transform may change the item.
    where = _where(item)
    ids = item.get("__id__") if skip_log is not None and isinstance(item, dict) else None
    try:
        return transform(item)
    except Exception as error:
        message = f"transform raised on {where}: {type(error).__name__}: {error}"
        if not skip:
            raise TransformError(message) from error
        counters.count_skipped()
        if ids is not None and skip_log is not None:
            skip_log.samples(ids, message)
        warnings.warn(f"skipped {message}", SampleSkippedWarning, stacklevel=3)
        return SKIPPED


def _where(item: Any) -> str:
    """The sample (its key and shard) or batch an item is, in words."""
    if isinstance(item, dict):
        key, url = item.get("__key__"), item.get("__url__")
        if key is not None and not isinstance(key, list):
            return f"sample {key!r} of shard {url}"
        if isinstance(key, list) and isinstance(url, list) and key and len(url) == len(key):
            return (
                f"a batch of {len(key)} samples, from sample {key[0]!r} of shard {url[0]} "
                f"to sample {key[-1]!r} of shard {url[-1]}"
            )
    rows = getattr(item, "num_rows", None)
    return f"a record batch of {rows} rows" if rows is not None else f"a {type(item).__name__}"

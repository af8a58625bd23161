"""``shardstream.Ledger``: a per-rank record of the samples each optimizer
step consumed, for ``shardstream verify`` to prove each epoch's coverage.

The dataset must be made with ``sample_ids=True`` (every sample then carries
``__id__ = (epoch, shard index, index in shard)``). The ledger is a folder::

    LEDGER_DIR/gen-000000/meta.json      what the run was (dataset, layout, first step)
    LEDGER_DIR/gen-000000/rank-00000.bin one append-only file of step records per rank

A new generation starts with each run: at step 0, or at ``resume_step``
after a resume, and its records of that step and later supersede, on every
rank, what earlier generations recorded. docs/ledger.md has the file format.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO

from ._core import LedgerRecords, option_table

if TYPE_CHECKING:
    import numpy as np
    import torch

    from .dataset import StreamingDataset
    from .mix import Mix
else:
    # Imported by ``_array_modules`` when first needed: ``import
    # shardstream`` imports neither numpy nor torch.
    np = torch = None

__all__ = ["Ledger", "SkipLog"]

LEDGER_FORMAT = "shardstream.ledger"
LEDGER_VERSION = 2

TRAINED, SKIPPED, EPOCH_END = 0, 1, 2
"""Record kinds: a step trained on its samples, skipped them, or the epoch ended."""

NARROW_IDS = 0x100
"""The bit of a record's kind that says its ids are narrow: ``u32`` shard
index and ``u32`` index in the shard (8 bytes a sample, not 16)."""

BUFFER_BYTES = 1 << 20
"""The rank file's write buffer."""

FLUSH_SAMPLES = 1 << 16
"""Records are queued until they hold this many samples (or a checkpoint,
an epoch's end or ``close`` comes), then written together."""

_Queued = tuple[int, int | None, int, Any, int]
"""A record waiting to be written: step, epoch (``None``: its first
sample's), kind, the ids as ``_plain_ids`` kept them (``None`` for an
epoch's end) and their count."""


def _generation_dir(generation: int) -> str:
    return f"gen-{generation:06d}"


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def _existing_generations(directory: Path) -> list[int]:
    """The generation numbers in ``directory`` (folders ``gen-NNNNNN``)."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        number = entry.name.removeprefix("gen-")
        digits = number.isascii() and number.isdigit()
        if entry.name.startswith("gen-") and digits and entry.is_dir():
            found.append(int(number))
    return sorted(found)


def _json_value(value: Any) -> Any:
    """``value`` as JSON takes it (other objects as their ``repr``)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return repr(value)


def mixture_meta(mix: Mix) -> dict[str, Any]:
    """What ``shardstream verify`` needs to replay a ``Mix``'s plan: each
    stream's ``dataset_meta`` and the mixture's weights, policy and seed
    (its samples' ids number the shards across streams and passes:
    ``shardstream.mix.mixture_shards``)."""
    from .mix import mixture_shards

    _, total = mixture_shards(mix.datasets)
    return {
        "spec": [],
        "options": {},
        "shards": total,
        "samples": None,
        "mix": {
            "streams": [dataset_meta(ds) for ds in mix.datasets],
            "weights": list(mix.weights),
            "policy": mix.policy,
            "seed": mix.seed,
        },
    }


def dataset_meta(dataset: StreamingDataset) -> dict[str, Any]:
    """What ``shardstream verify`` needs to replay ``dataset``'s plan: its
    spec as given, the options that decide the order of samples (the
    options table's ``order`` marker), the manifest in use, and its size."""
    given = dataset.options.to_dict()
    options = {
        row["name"]: _json_value(given[row["name"]])
        for row in option_table()
        if row["affects_order"] and row["name"] != "model_parallel_size"
    }
    pack = given.get("pack")
    if pack is not None:
        # What verify replays a packed epoch's plan with.
        options["pack"] = {
            "seq_len": pack.seq_len,
            "mode": pack.mode,
            "field": pack.field,
            "window": pack.window,
            "labels": pack.labels,
            "pad_id": pack.pad_id,
        }
    shard_list = dataset.shard_list
    if shard_list.manifest_path is not None and options.get("manifest") is not False:
        options["manifest"] = os.fspath(shard_list.manifest_path)
    counts = shard_list.sample_counts
    return {
        "spec": list(shard_list.specs),
        "options": options,
        "shards": len(shard_list),
        "samples": None if counts is None else sum(counts),
    }


def _array_modules() -> None:
    """Imports numpy and torch into this module's globals (once)."""
    global np, torch
    if torch is None:
        import numpy
        import torch as torch_module

        np, torch = numpy, torch_module


def _as_array(value: Any) -> np.ndarray:
    """A tensor (on any device), array, list or int as a numpy array."""
    if hasattr(value, "detach"):
        if value.requires_grad or value.device.type != "cpu":
            value = value.detach().cpu()
        return value.numpy()
    return np.asarray(value)


def id_columns(batch: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The epoch, shard and index columns (1-D ``uint64``, views where they
    can be) of ``batch``'s ``__id__``: a DataLoader batch (a list of 3
    tensors), a Rust batch (a ``(B, 3)`` array) or one sample (a tuple of 3
    ints). Raises ``ValueError`` when there is none."""
    _array_modules()
    if not isinstance(batch, Mapping) or "__id__" not in batch:
        kind = f"keys {sorted(batch)[:8]}" if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(
            f"the batch has no __id__ field ({kind}): create the dataset with "
            "sample_ids=True, and keep __id__ in the batch when a transform or collate_fn "
            "rebuilds it"
        )
    ids = batch["__id__"]
    if isinstance(ids, (list, tuple)) and len(ids) == 3 and not np.isscalar(ids[0]):
        # default_collate: one tensor per component.
        columns = [_as_array(part).reshape(-1) for part in ids]
    else:
        rows = _as_array(ids)
        rows = rows.reshape(1, 3) if rows.ndim == 1 and rows.size == 3 else rows
        if rows.ndim != 2 or rows.shape[1] != 3:
            raise _not_ids(f"an array of shape {rows.shape} and type {rows.dtype}")
        columns = [rows[:, 0], rows[:, 1], rows[:, 2]]
    count = len(columns[0])
    for column in columns:
        integers = column.dtype == np.int64 or np.issubdtype(column.dtype, np.integer)
        if not integers or len(column) != count:
            shapes = ", ".join(f"{len(c)} of {c.dtype}" for c in columns)
            raise _not_ids(f"3 columns of {shapes}")
    # The ids are never negative: int64 columns are read as uint64 in place.
    epoch, shard, index = (
        c.view(np.uint64) if c.dtype == np.int64 else c.astype(np.uint64) for c in columns
    )
    return epoch, shard, index


def _ends_no_document(ids: Any) -> bool:
    """Whether ``ids`` are a packed sequence's (or batch's) ``(0, 3)`` rows:
    no document ends in it (``pack`` with ``sample_ids``)."""
    shape = getattr(ids, "shape", None)
    return shape is not None and tuple(shape) == (0, 3)


def _sequence_epoch(batch: Any) -> int:
    """The epoch of a packed batch's sequences: their ``__epoch__`` (a
    ``(1,)`` array per sequence, ``(B, 1)`` per batch)."""
    epoch = batch.get("__epoch__")
    if epoch is None:
        raise ValueError(
            "a packed step in which no document ends carries its epoch in __epoch__ "
            "(sample_ids=True), and this batch has none"
        )
    return int(np.asarray(epoch).reshape(-1)[0])


def _plain_ids(batch: Any) -> tuple[Any, int] | None:
    """``batch``'s ``__id__`` as the common batches hold it, kept without a
    copy, and its sample count: a ``(B, 3)`` ``int64`` array (Rust
    batches), or three 1-D columns of one length (DataLoader's default
    collate): ``int64`` arrays, or tensors, whose type and device
    ``_JoinBuffers.join`` checks when the records are written. ``None`` for any
    other form, which ``id_columns`` reads (or refuses)."""
    ids: Any = batch.get("__id__") if type(batch) is dict or isinstance(batch, Mapping) else None
    kind = type(ids)
    if kind is np.ndarray:
        if ids.ndim == 2 and ids.shape[1] == 3 and ids.dtype == np.int64 and len(ids):
            return ids, len(ids)
        return None
    if kind is not list or len(ids) != 3:
        return None
    first, second, third = ids
    kind = type(first)
    if kind is torch.Tensor:
        if type(second) is not kind or type(third) is not kind:
            return None
    elif kind is not np.ndarray or any(c.dtype != np.int64 for c in ids):
        return None
    shape = first.shape
    if len(shape) != 1 or shape[0] == 0 or second.shape != shape or third.shape != shape:
        return None
    return ids, shape[0]


class _JoinBuffers:
    """Where a flush joins the ids it writes, kept from one flush to the
    next: a fresh array of a flush's size (1.5 MB at ``FLUSH_SAMPLES``)
    would be faulted in page by page at each flush, which costs more than
    the rest of recording (16 ns a sample against 2, measured)."""

    def __init__(self) -> None:
        self.rows = np.empty((0, 3), np.int64)
        self.columns = torch.empty((3, 0), dtype=torch.int64)

    def join(self, payloads: list[Any], count: int) -> Any:
        """The ids ``_plain_ids`` kept (or ``_record`` made of
        ``id_columns``), ``count`` of them, in order, as
        ``LedgerRecords.push`` takes them: the Rust batches' arrays
        joined in one ``(N, 3)`` array, tensors joined per column (one
        transfer from a device for all of them), else three columns."""
        if all(type(ids) is np.ndarray for ids in payloads):
            if len(self.rows) < count:
                self.rows = np.empty((max(count, FLUSH_SAMPLES), 3), np.int64)
            return np.concatenate(payloads, out=self.rows[:count])
        if all(type(ids[0]) is torch.Tensor for ids in payloads):
            # Integer ids need no detach; another type, or tensors on
            # several devices, fail the join and are read one by one below.
            try:
                if payloads[0][0].device.type != "cpu":
                    joined = [torch.cat([ids[c] for ids in payloads]) for c in range(3)]
                    if all(t.dtype == torch.int64 for t in joined):
                        return tuple(t.cpu().numpy() for t in joined)
                else:
                    if self.columns.shape[1] < count:
                        size = (3, max(count, FLUSH_SAMPLES))
                        self.columns = torch.empty(size, dtype=torch.int64)
                    out = self.columns[:, :count]
                    for c in range(3):
                        torch.cat([ids[c] for ids in payloads], out=out[c])
                    return tuple(out.numpy())
            except (RuntimeError, TypeError):
                pass
        parts: tuple[list[Any], list[Any], list[Any]] = ([], [], [])
        for ids in payloads:
            columns: tuple[Any, ...]
            if type(ids) is np.ndarray:
                columns = (ids[:, 0], ids[:, 1], ids[:, 2])
            else:
                columns = tuple(c.view(np.int64) for c in id_columns({"__id__": ids}))
            for part, column in zip(parts, columns, strict=True):
                part.append(column)
        return tuple(np.ascontiguousarray(np.concatenate(part)) for part in parts)


def _not_ids(got: str) -> ValueError:
    return ValueError(f"__id__ is not (epoch, shard, index) per sample: got {got}")


def sample_ids(batch: Any) -> np.ndarray:
    """The ``(epoch, shard, index)`` rows of ``batch``'s ``__id__`` (see
    ``id_columns``), as a ``(B, 3)`` ``uint64`` array."""
    columns = id_columns(batch)
    return np.stack(columns, axis=1)


class Ledger:
    """The sample ledger of one rank: the ids each step consumed, appended
    to ``directory/gen-NNNNNN/rank-RRRRR.bin``, flushed per step.

    Args:
        directory: the ledger folder, shared by every rank (and run) of the job.
        dataset: the ``StreamingDataset`` (made with ``sample_ids=True``),
            or a ``Mix`` of such streams (``verify`` then replays the
            mixture's plan).
        resume_step: the first step this run takes after resuming from a
            checkpoint (the number of steps done when it was saved, as
            ``checkpoint()`` returned it); ``None`` for a fresh run (step 0).
            This run's records of that step and later supersede, on every
            rank, what earlier runs recorded.
        rank, world_size: the data-parallel slot; default: the dataset's
            (``torch.distributed``, else ``RANK``/``WORLD_SIZE``). Ranks of
            one model-parallel group read the same samples: only the first
            of each group writes.
        num_workers: the DataLoader's ``num_workers`` (``track`` fills it
            in from the loader when not given).

    Each run opens a new generation, numbered after the folder's last.
    Under an initialised ``torch.distributed`` process group rank 0 picks
    the number and broadcasts it: the constructor is then a collective,
    to be called on every rank. Without it, the job's first process (rank
    0, the first of its model-parallel group) makes the generation and the
    others join the newest one, so its ``Ledger`` must be made first
    (in-process simulations, or ranks started without a process group).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        dataset: StreamingDataset | Mix,
        *,
        resume_step: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int | None = None,
    ) -> None:
        _array_modules()
        for name, value in (
            ("resume_step", resume_step),
            ("rank", rank),
            ("world_size", world_size),
            ("num_workers", num_workers),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"Ledger {name}: expected None or an int, got {value!r}")
            if value is not None and value < (1 if name in ("world_size", "num_workers") else 0):
                raise ValueError(f"Ledger {name}: out of range, got {value}")
        found = getattr(dataset, "datasets", None)
        mixture = isinstance(found, list)
        streams: list[Any] = found if isinstance(found, list) else [dataset]
        if not all(ds.options["sample_ids"] for ds in streams):
            raise ValueError(
                "the dataset hands out no sample ids: create it with sample_ids=True for "
                "a Ledger to record" + (" (every stream of the Mix)" if mixture else "")
            )
        self.directory = Path(directory)
        # A mixture's weights may change between epochs (set_weights): each
        # epoch's are written into the meta when its first step is recorded.
        self._mix: Mix | None = dataset if mixture else None  # type: ignore[assignment]
        self._weights_epoch: int | None = None
        # Packed sequences name the documents that end in them: a step may
        # end none.
        self._packed = streams[0].options["pack"] is not None
        # A mixture's streams share one layout: the first one's.
        layout = streams[0]
        data_rank, data_world = layout.distributed_slot()
        process_rank, _ = layout.process_slot()
        group = int(layout.options["model_parallel_size"])
        self.rank = data_rank if rank is None else rank
        self.world_size = data_world if world_size is None else world_size
        if self.rank >= self.world_size:
            raise ValueError(f"Ledger rank: {self.rank} is not below world_size {self.world_size}")
        # Ranks of a model-parallel group see the same samples: one writes.
        self._writes = rank is not None or process_rank % group == 0
        self.start_step = 0 if resume_step is None else resume_step
        self._num_workers_given = num_workers is not None
        self._next_step = self.start_step
        self._last_step: int | None = None
        meta = {
            "format": LEDGER_FORMAT,
            "version": LEDGER_VERSION,
            "generation": 0,
            "start_step": self.start_step,
            "world_size": self.world_size,
            "num_workers": num_workers if num_workers is not None else 1,
            # Whether verify may replay each worker's slot.
            "num_workers_known": num_workers is not None,
            "dataset": mixture_meta(dataset) if mixture else dataset_meta(dataset),  # type: ignore[arg-type]
        }
        # Without a process group the job's first process makes the
        # generation (the first of data rank 0's model-parallel group, not
        # any process of that data rank), the others join it.
        creates = process_rank == 0 if rank is None else self.rank == 0
        self.generation = self._open_generation(meta, creates)
        self._file: BinaryIO | None = None
        self._queued: list[_Queued] = []
        self._queued_samples = 0
        self._last_ids: Any = None
        # The last step that named no sample (a packed one): (step, epoch).
        self._empty_step: tuple[int, int] | None = None
        self._join = _JoinBuffers()
        self._records = LedgerRecords()
        # The skip logs this ledger gave its streams, taken back at close.
        self._skip_logs: list[tuple[Any, SkipLog]] = []
        if self._writes:
            path = self.directory / _generation_dir(self.generation) / _rank_file(self.rank)
            self._file = open(path, "ab", buffering=BUFFER_BYTES)  # noqa: SIM115 (closed by close())
            # The streams record what on_error="warn" leaves out beside it:
            # DataLoader workers made after this get the log with the dataset.
            skips = self.path / _skips_file(self.rank)
            if mixture:
                from .mix import mixture_shards

                offsets, total = mixture_shards(streams)
                for s, ds in enumerate(streams):
                    ds.skip_log = SkipLog(skips, (s, offsets, total))
                    self._skip_logs.append((ds, ds.skip_log))
            else:
                dataset.skip_log = SkipLog(skips)  # type: ignore[union-attr]
                self._skip_logs.append((dataset, dataset.skip_log))  # type: ignore[union-attr]

    @property
    def path(self) -> Path:
        """This generation's folder."""
        return self.directory / _generation_dir(self.generation)

    def _open_generation(self, meta: dict[str, Any], creates: bool) -> int:
        """The number of this run's generation, its folder made by rank 0
        of the process group, else by the process that ``creates`` it."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            chosen: list[Any] = [None]
            if dist.get_rank() == 0:
                try:
                    chosen = [self._create_generation(meta)]
                except OSError as error:
                    chosen = [f"cannot create the ledger generation in {self.directory}: {error}"]
            dist.broadcast_object_list(chosen, src=0)
            if isinstance(chosen[0], str):
                raise OSError(chosen[0])
            return int(chosen[0])
        if creates:
            return self._create_generation(meta)
        return self._join_generation(meta)

    def _create_generation(self, meta: dict[str, Any]) -> int:
        """Makes the folder's next generation with ``meta``; its number."""
        self.directory.mkdir(parents=True, exist_ok=True)
        existing = _existing_generations(self.directory)
        generation = existing[-1] + 1 if existing else 0
        while True:
            folder = self.directory / _generation_dir(generation)
            try:
                folder.mkdir()
                break
            except FileExistsError:
                generation += 1
        meta["generation"] = generation
        _write_json(folder / "meta.json", meta)
        return generation

    def _join_generation(self, meta: dict[str, Any]) -> int:
        """The newest generation, made by rank 0 for this run."""
        existing = _existing_generations(self.directory)
        if not existing:
            raise ValueError(
                f"ledger {self.directory} has no generation for rank {self.rank} to join: "
                "make the Ledger of the job's first process (rank 0) first, or initialise "
                "torch.distributed"
            )
        generation = existing[-1]
        folder = self.directory / _generation_dir(generation)
        theirs = json.loads((folder / "meta.json").read_text())
        mine = (self.start_step, self.world_size)
        # A process that does not write shares its rank's file with the
        # one of its model-parallel group that does.
        if (theirs["start_step"], theirs["world_size"]) != mine or (
            self._writes and (folder / _rank_file(self.rank)).exists()
        ):
            raise ValueError(
                f"ledger {self.directory}: the newest generation ({folder.name}, from step "
                f"{theirs['start_step']}, world_size {theirs['world_size']}) is not this "
                f"run's (from step {self.start_step}, world_size {self.world_size}) or "
                f"already has rank {self.rank}: make rank 0's Ledger of this run first"
            )
        return generation

    def _write(self, step: int, epoch: int | None, kind: int, ids: Any, count: int) -> None:
        """Adds a record, written with the others at the next flush (when
        they hold FLUSH_SAMPLES, and at checkpoints, epoch ends and close),
        so that a step costs a microsecond or two whatever its size. A Rust
        batch's ids (and an epoch's end) are encoded at once, while the
        batch is fresh in the cache; tensors wait in a queue, joined at the
        flush (the records keep their order: once one waits, the next ones
        wait too)."""
        if self._file is None:
            if self._writes:
                raise ValueError(f"ledger {self.path} rank {self.rank} is closed")
            return
        if self._queued or not (ids is None or type(ids) is np.ndarray):
            self._queued.append((step, epoch, kind, ids, count))
            self._queued_samples += count
        elif ids is None:
            self._records.push([step], [epoch], [kind], [0], self._join.rows[:0])
        else:
            self._records.push_batch(step, kind, ids)
        if self._queued_samples + self._records.samples >= FLUSH_SAMPLES:
            self._flush()

    def _flush(self) -> None:
        """Writes the records held: each its header and its (shard, index)
        pairs (encoded by ``LedgerRecords``, which checks that each step's
        samples are of one epoch). Buffered: a crash leaves at most the last
        record cut short, and loses only records after the last checkpoint,
        which the resumed run's generation supersedes."""
        queued, self._queued, self._queued_samples = self._queued, [], 0
        if queued:
            payloads = [q[3] for q in queued if q[4]]
            counts = [q[4] for q in queued]
            ids = self._join.join(payloads, sum(counts)) if payloads else self._join.rows[:0]
            self._records.push(
                [q[0] for q in queued], [q[1] for q in queued], [q[2] for q in queued], counts, ids
            )
        encoded = self._records.take()
        if self._file is not None and encoded:
            self._file.write(encoded)

    def record(self, batch: Any, step: int | None = None) -> int:
        """Records the samples of ``batch`` as trained at ``step`` (default:
        the step after the previous one; this run's first is
        ``resume_step``). Returns the step."""
        return self._record(batch, step, TRAINED)

    @property
    def last_epoch(self) -> int | None:
        """The epoch of the last batch recorded (``None`` before the first)."""
        empty = self._empty_step
        if empty is not None and empty[0] == self._last_step:
            return empty[1]
        ids = self._last_ids
        if ids is None:
            return None
        return int(ids[0, 0]) if type(ids) is np.ndarray else int(ids[0][0])

    def _record(self, batch: Any, step: int | None, kind: int) -> int:
        step = self._record_batch(batch, step, kind)
        if self._mix is not None:
            self._note_mix_weights()
        return step

    def _note_mix_weights(self) -> None:
        """Writes the mixture's weights into this generation's meta
        (``weights_by_epoch``) when a step of an epoch not seen yet is
        recorded (rank 0), so that ``verify`` replays each epoch with the
        weights it mixed by, ``set_weights`` between epochs included."""
        epoch = self.last_epoch
        if epoch is None or epoch == self._weights_epoch or self._mix is None:
            return
        self._weights_epoch = epoch
        if self.rank != 0 or not self._writes:
            return
        meta_path = self.path / "meta.json"
        meta = json.loads(meta_path.read_text())
        by_epoch = meta["dataset"]["mix"].setdefault("weights_by_epoch", {})
        weights = self._mix._epoch_weights(epoch)
        if by_epoch.get(str(epoch)) != weights:
            by_epoch[str(epoch)] = weights
            _write_json(meta_path, meta)

    def _record_batch(self, batch: Any, step: int | None, kind: int) -> int:
        step = self._next_step if step is None else step
        if step < self.start_step:
            raise ValueError(
                f"step {step} is before this run's first step {self.start_step} (resume_step)"
            )
        # A DataLoader batch's three CPU tensors are encoded now, while
        # fresh in the cache (``LedgerRecords.push_tensors``); other ids are
        # kept as the batch holds them (no copy, no per-step check beyond
        # their form), checked and written together (``_flush``), so that
        # a step costs a microsecond or two.
        ids = batch.get("__id__") if type(batch) is dict else None
        if type(ids) is list and len(ids) == 3 and self._file is not None and not self._queued:
            held = self._records.push_tensors(step, kind, ids[0], ids[1], ids[2])
            if held:
                if held >= FLUSH_SAMPLES:
                    self._flush()
                self._last_ids, self._last_step, self._next_step = ids, step, step + 1
                return step
        plain = _plain_ids(batch)
        if plain is None:
            columns = id_columns(batch)
            if len(columns[0]) == 0:
                if self._packed and _ends_no_document(batch.get("__id__")):
                    # A packed batch whose sequences all go on into the next
                    # (no document ends in it): a step that names no sample,
                    # recorded in its sequences' epoch (``__epoch__``) so that
                    # every rank's steps count.
                    epoch = _sequence_epoch(batch)
                    self._write(step, epoch, kind, None, 0)
                    self._last_step, self._next_step = step, step + 1
                    self._empty_step = (step, epoch)
                    return step
                raise ValueError("a step's batch has no samples")
            plain = [c.view(np.int64) for c in columns], len(columns[0])
        ids, count = plain
        self._write(step, None, kind, ids, count)
        self._last_ids, self._last_step, self._next_step = ids, step, step + 1
        return step

    def epoch_end(self, epoch: int) -> None:
        """Records that this rank has taken every batch of ``epoch``."""
        step = self._last_step if self._last_step is not None else self.start_step
        self._write(step, epoch, EPOCH_END, None, 0)
        self._flush()

    def track(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Iterates ``loader`` (a DataLoader, or an iterator already
        started), recording each batch as a step before handing it out, and
        the end of the epoch when the iteration ends."""
        workers = getattr(loader, "num_workers", None)
        if not self._num_workers_given and isinstance(workers, int) and self._last_step is None:
            self._set_num_workers(max(workers, 1))
        recorded = False
        for batch in loader:
            self.record(batch)
            recorded = True
            yield batch
        epoch = self.last_epoch
        if recorded and epoch is not None:
            self.epoch_end(epoch)

    def _set_num_workers(self, num_workers: int) -> None:
        """Writes ``num_workers`` into this generation's meta (rank 0, before any step)."""
        if self.rank != 0 or not self._writes:
            return
        meta_path = self.path / "meta.json"
        meta = json.loads(meta_path.read_text())
        if meta["num_workers"] != num_workers or not meta.get("num_workers_known"):
            meta["num_workers"] = num_workers
            meta["num_workers_known"] = True
            _write_json(meta_path, meta)

    def skip_steps(self, count: int, loader_iterator: Iterator[Any]) -> int:
        """Draws ``count`` batches from ``loader_iterator`` and records them as
        skipped (the data of a loss spike, left out on purpose): the
        iterator goes on after them, and ``verify`` counts their samples
        as taken. Returns the batches drawn (fewer when the epoch ends
        first; its end is then recorded)."""
        drawn = 0
        epoch = None
        for _ in range(count):
            try:
                batch = next(loader_iterator)
            except StopIteration:
                if epoch is not None:
                    self.epoch_end(epoch)
                break
            self._record(batch, None, SKIPPED)
            epoch = self.last_epoch
            drawn += 1
        return drawn

    def checkpoint(self, step: int | None = None) -> int:
        """Makes what this rank recorded durable (``fsync``): call it where
        the training state is saved. Returns the step a run resumed from
        this checkpoint takes first (``step`` when given, else the step
        after the last recorded), its ``resume_step``."""
        self._flush()
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
        return self._next_step if step is None else step

    def close(self) -> None:
        """Makes the records durable and closes this rank's file. The
        streams' iterations started after this record their skips nowhere
        (unless a later ledger gave them its log)."""
        for dataset, log in self._skip_logs:
            if dataset.skip_log is log:
                dataset.skip_log = None
        self._skip_logs = []
        self._flush()
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
        self._writes = False

    def __enter__(self) -> Ledger:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Ledger({os.fspath(self.directory)!r}, generation={self.generation}, "
            f"rank={self.rank}, world_size={self.world_size}, start_step={self.start_step})"
        )


def _skips_file(rank: int) -> str:
    return f"rank-{rank:05d}.skips.jsonl"


class SkipLog:
    """Where a rank's streams record the samples they leave out under
    ``on_error="warn"`` (``gen-NNNNNN/rank-RRRRR.skips.jsonl``), and with
    ``pack`` the documents with no tokens that no sequence carries, so that
    ``shardstream verify`` accounts for them. The ``Ledger`` gives one to
    its dataset (to each stream of a ``Mix``); DataLoader workers get it
    with their copy of the dataset and append to the same file, one line
    per skip, each written whole (``O_APPEND``) and made durable at once.

    Args:
        path: the skips file.
        stream: for a ``Mix``, the stream this log is its dataset's, with
            the mixture's shard numbering (``mixture_shards``): a stream's
            epoch and shard are then written as the mixture's ids.
    """

    def __init__(
        self, path: str | os.PathLike[str], stream: tuple[int, list[int], int] | None = None
    ) -> None:
        self.path = os.fspath(path)
        self.stream = stream

    def __call__(
        self,
        epoch: int,
        shard: int,
        first: int,
        end: int | None,
        reason: str,
        cause: str = "error",
    ) -> None:
        """Records that a stream of ``epoch`` left out samples ``first..end``
        of ``shard`` (``end`` ``None``: to the shard's end), at an error
        (``cause`` ``"error"``) or as documents with no tokens that its
        packer had no sequence to carry (``"no_tokens"``); the stream's
        ``on_skip``."""
        if self.stream is not None:
            from .mix import mixture_id

            s, offsets, total = self.stream
            epoch, shard = mixture_id((offsets, total), s, epoch, shard)
        self._append([(epoch, shard, first, end)], reason, cause)

    def samples(self, ids: Any, reason: str) -> None:
        """Records that the samples ``ids`` (an item's ``__id__``: one
        ``(epoch, shard, index)``, or a batch's) were left out: a transform
        raised on them. The ids are the ledger's already (a ``Mix`` gives
        its transforms the mixture's)."""
        try:
            columns = id_columns({"__id__": ids})
        except ValueError:
            return
        self._append(
            [(int(e), int(s), int(i), int(i) + 1) for e, s, i in zip(*columns, strict=True)],
            reason,
        )

    def _append(
        self, ranges: list[tuple[int, int, int, int | None]], reason: str, cause: str = "error"
    ) -> None:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker = None if info is None else info.id
        fields = {"worker": worker, "reason": reason, "cause": cause}
        lines = "".join(
            json.dumps({"epoch": e, "shard": s, "first": f, "end": n, **fields}) + "\n"
            for e, s, f, n in ranges
        )
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, lines.encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def __repr__(self) -> str:
        return f"SkipLog({self.path!r})"


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    """Writes ``value`` to ``path`` whole or not at all (a renamed temporary file)."""
    partial = path.with_suffix(".json.partial")
    with open(partial, "w") as out:
        json.dump(value, out, indent=1)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)

"""Hugging Face Accelerate (and the HF Trainer, which runs on it).

A ``StreamingDataset`` splits the data between ranks itself, before any
byte is read. ``accelerator.prepare(loader)`` splits it again: by default
(an ``IterableDataset``, device placement on) rank 0 alone iterates the
loader and hands slices of its batches to the others
(``DataLoaderDispatcher``); with ``dispatch_batches=False`` every rank
wraps its dataset in ``IterableDatasetShard``, which keeps 1/N of what it
gets. Either way a job of N ranks trains on 1/N of the data. The dataset
therefore raises ``FrameworkWrapperError`` at the first batch when one of
those wrappers splits it between several ranks (``shardstream.resplit``
finds them), and ``prepare_loader``
prepares the loader the way it needs: device placement, Accelerate's
end-of-epoch and gradient-accumulation bookkeeping, ``save_state`` /
``load_state``, and no second split.

Nothing here imports ``accelerate`` until ``prepare_loader`` runs.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .ledger import Ledger
from .resplit import FrameworkWrapperError, check_not_resplit

__all__ = ["FrameworkWrapperError", "check_not_resplit", "prepare_loader"]

RANK_STATES = "shardstream.rank_states"
"""The ``format`` of a loader state that holds every rank's."""


def prepare_loader(
    accelerator: Any, loader: Any, *, ledger_dir: str | os.PathLike[str] | None = None
) -> Any:
    """``accelerator.prepare(loader)`` for a DataLoader over a dataset that
    splits the data between ranks itself (``StreamingDataset``, ``Mix``):
    batches are placed on ``accelerator.device``, the loader takes part in
    Accelerate's epoch-end and gradient-accumulation bookkeeping,
    ``accelerator.save_state`` / ``load_state`` keep its state
    (``DataLoaderConfiguration(use_stateful_dataloader=True)``), and no rank
    drops or receives another rank's batches. Returns the prepared loader;
    passing it to ``accelerator.prepare`` again returns it unchanged.

    With several ranks and a stateful loader, the prepared loader's
    ``state_dict()`` gathers every rank's state (a collective: call it on
    every rank, as ``accelerator.save_state`` does), so the one file
    Accelerate writes holds them all, and ``load_state_dict`` gives each
    rank its own back.

    With ``ledger_dir``, the prepared loader writes a ``shardstream.Ledger``
    there (the dataset made with ``sample_ids=True``; ``collate_fn`` keeping
    ``__id__``): each batch is recorded as a step when the loader hands it
    out, and the epoch's end with its last batch. The ledger is registered
    with ``accelerator.register_for_checkpointing``: ``save_state`` makes
    the records durable and keeps the step a resumed run records first, and
    ``load_state`` starts the resumed run's generation there, so that
    ``shardstream verify LEDGER_DIR`` checks the whole run, resumes included.
    """
    from accelerate.data_loader import prepare_data_loader  # type: ignore[import-untyped]
    from torch.utils.data import DataLoader

    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"prepare_loader takes a torch DataLoader, got {type(loader).__name__}: pass the "
            "model and optimizer to accelerator.prepare"
        )
    if getattr(loader, "_is_accelerate_prepared", False):
        return loader
    _check_processes(accelerator)
    # Accelerate hands its own epoch count to set_epoch at each new
    # iterator (and does not count a pass that yields nothing): it starts
    # from the dataset's epoch, so a dataset set to an epoch, or holding a
    # loaded state (one saved at an epoch's end streams the next epoch), is
    # not sent back to an epoch it has streamed. Read before Accelerate
    # makes its first iterator.
    epoch = getattr(loader.dataset, "epoch", None)
    prepared = prepare_data_loader(
        loader,
        accelerator.device,
        # The dataset gives this rank its own part: Accelerate must not split it again.
        num_processes=1,
        process_index=0,
        split_batches=False,
        put_on_device=accelerator.device_placement,
        rng_types=accelerator.rng_types.copy(),
        dispatch_batches=False,
        even_batches=accelerator.even_batches,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
    )
    if isinstance(epoch, int):
        prepared.iteration = epoch
    if accelerator.use_stateful_dataloader:
        _follow_loaded_epoch(prepared)
    if accelerator.use_stateful_dataloader and accelerator.num_processes > 1:
        _gather_states(prepared, accelerator.process_index, accelerator.num_processes)
    if ledger_dir is not None:
        recorder = LoaderLedger(ledger_dir, loader.dataset, loader.num_workers)
        _record_batches(prepared, recorder)
        accelerator.register_for_checkpointing(recorder)
    prepared._is_accelerate_prepared = True
    # What accelerator.prepare does with a loader it made: save_state,
    # load_state, skip_first_batches and free_memory find it here.
    accelerator._dataloaders.append(prepared)
    return prepared


class LoaderLedger:
    """The ledger of a loader prepared with ``prepare_loader(...,
    ledger_dir=...)``, checkpointed by Accelerate with the loader:
    ``state_dict`` (``save_state``) makes the records durable and holds the
    step a run resumed from the checkpoint records first; ``load_state_dict``
    (``load_state``) starts this run's generation at that step. The
    generation is opened at the first batch (a collective under
    ``torch.distributed``: every rank reads its loader), and closed when
    the process exits, or by ``close()``."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        dataset: Any,
        num_workers: int,
        owner: str = "prepare_loader",
    ) -> None:
        # A StreamingDataset or a Mix of them (not imported here: both
        # modules import this one).
        streams = getattr(dataset, "datasets", None)
        sources = streams if isinstance(streams, list) else [dataset]
        if not all(hasattr(ds, "distributed_slot") for ds in sources):
            raise TypeError(
                f"{owner}(ledger_dir=...) records a StreamingDataset or a Mix, got "
                f"{type(dataset).__name__}"
            )
        if not all(ds.options["sample_ids"] for ds in sources):
            raise ValueError(
                f"{owner}(ledger_dir=...): the dataset hands out no sample ids: create "
                "it (every stream of a Mix) with sample_ids=True for the ledger to record"
            )
        self.directory = Path(directory)
        self.dataset = dataset
        self.num_workers = max(int(num_workers), 1)
        self.resume_step: int | None = None
        self.ledger: Ledger | None = None
        atexit.register(self.close)

    def record(self, batch: Any, last: bool) -> None:
        """Records ``batch`` as the next step (and the epoch's end when it is the last)."""
        if self.ledger is None:
            self.ledger = Ledger(
                self.directory,
                self.dataset,
                resume_step=self.resume_step,
                num_workers=self.num_workers,
            )
        self.ledger.record(batch)
        if last:
            self.epoch_end()

    def epoch_end(self) -> None:
        """Records the end of the epoch of the last batch recorded (if any)."""
        if self.ledger is not None and self.ledger.last_epoch is not None:
            self.ledger.epoch_end(self.ledger.last_epoch)

    def state_dict(self) -> dict[str, int]:
        """Makes the records durable; the step a run resumed from this checkpoint takes first."""
        if self.ledger is not None:
            return {"resume_step": self.ledger.checkpoint()}
        return {"resume_step": self.resume_step or 0}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Starts a new generation at the checkpoint's step with the next batch."""
        step = state.get("resume_step") if isinstance(state, Mapping) else None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(
                f"the checkpoint's shardstream ledger entry is not {{'resume_step': int}}: "
                f"got {state!r}"
            )
        self.close()
        self.resume_step = step

    def close(self) -> None:
        """Makes the records durable and closes this rank's file."""
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None


def _record_batches(prepared: Any, recorder: LoaderLedger) -> None:
    """Makes ``prepared`` record each batch in ``recorder`` as it hands it
    out (after Accelerate's one-batch read-ahead and skipped batches)."""
    loader_class = type(prepared)  # not __class__: Accelerate's loaders report the wrapped class

    def recorded(self: Any) -> Iterator[Any]:
        for batch in loader_class.__iter__(self):
            # Accelerate knows the last batch before it hands it out.
            recorder.record(batch, last=bool(self.end_of_dataloader))
            yield batch

    recording = type(
        f"Ledger{loader_class.__name__}",
        (loader_class,),
        {"__iter__": recorded, "__module__": __name__, "ledger": recorder},
    )
    # Accelerate's loaders make __class__ a read-only property; object's
    # own slot sets the type.
    object.__dict__["__class__"].__set__(prepared, recording)


def _job_world_size() -> tuple[int, str]:
    """The number of processes of the job as a dataset sees it, and where it
    comes from: torch.distributed's world size when initialised, else the
    ``WORLD_SIZE`` that torchrun (or another launcher) sets, else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), "torch.distributed's world size"
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"]), f"WORLD_SIZE={os.environ['WORLD_SIZE']}"
    return 1, "no torch.distributed nor WORLD_SIZE"


def _check_processes(accelerator: Any) -> None:
    """Raises ``FrameworkWrapperError`` when ``accelerator`` counts another
    number of processes than the job has (as torch.distributed or
    ``WORLD_SIZE`` say): under torchrun on a machine without GPUs, an
    ``Accelerator()`` without ``cpu=True`` reports one process on each rank
    and prepares the model for one process, and every rank would then train
    a model of its own, never synchronised, on its part of the data."""
    world_size, source = _job_world_size()
    if accelerator.num_processes == world_size:
        return
    raise FrameworkWrapperError(
        f"accelerator.num_processes is {accelerator.num_processes} but the job has "
        f"{world_size} processes ({source}): Accelerate did not set up training across "
        "the job's processes, so each rank would train a model of its own, never "
        "synchronised, on its part of the data. Fix: on a machine without GPUs create "
        "Accelerator(cpu=True) (torchrun on CPU needs it), or start the job with "
        "`accelerate launch` (its configuration sets the processes up)"
    )


def _follow_loaded_epoch(prepared: Any) -> None:
    """Makes ``prepared.load_state_dict`` also set Accelerate's epoch count
    (``iteration``, which it hands to ``set_epoch`` at each new iterator)
    to the epoch the loaded state resumes: a fresh loader counts from 0,
    and would otherwise set the resumed dataset back to an epoch it has
    already streamed (after a state saved at an epoch's end, the next epoch
    twice)."""
    from .state import elastic_state

    own_load_state_dict = prepared.load_state_dict

    def load_state_dict(state: Mapping[str, Any]) -> None:
        own_load_state_dict(state)
        try:
            slots = elastic_state(state)["slots"]
        except ValueError:  # no shardstream state in it
            return
        epochs = {slot.get("epoch") for slot in slots}
        if len(epochs) != 1 or not isinstance(epoch := epochs.pop(), int):
            return
        ended = bool(state.get("_iterator_finished")) or all(s.get("finished") for s in slots)
        prepared.iteration = epoch + 1 if ended else epoch

    prepared.load_state_dict = load_state_dict


def _gather_states(prepared: Any, rank: int, world_size: int) -> None:
    """Makes ``prepared.state_dict()`` every rank's state (gathered) and
    ``prepared.load_state_dict`` take this rank's from such a state."""
    import torch.distributed as dist

    own_state_dict = prepared.state_dict
    own_load_state_dict = prepared.load_state_dict

    def state_dict() -> dict[str, Any]:
        states: list[Any] = [None] * world_size
        dist.all_gather_object(states, own_state_dict())
        return {"format": RANK_STATES, "world_size": world_size, "ranks": states}

    def load_state_dict(state: Mapping[str, Any]) -> None:
        own_load_state_dict(rank_state(state, rank, world_size))

    prepared.state_dict = state_dict
    prepared.load_state_dict = load_state_dict


def rank_state(state: Mapping[str, Any], rank: int, world_size: int) -> Any:
    """This rank's loader state from a state that gathers every rank's (as
    ``prepare_loader``'s loaders and ``shardstream.lightning.ShardStreamCallback``
    save them); any other state is returned as it is."""
    if not (isinstance(state, Mapping) and state.get("format") == RANK_STATES):
        return state
    from ._core import StateMismatchError

    saved = state.get("world_size")
    ranks = state.get("ranks")
    if not isinstance(ranks, list) or saved != world_size or len(ranks) != world_size:
        raise StateMismatchError(
            f"state field world_size: the loader states were saved by {saved} ranks and this "
            f"job has {world_size}: resume with {saved} ranks, or load "
            "shardstream.elastic_state(*state['ranks']) into the dataset (not the DataLoader) "
            "to resume with another world size"
        )
    return ranks[rank]

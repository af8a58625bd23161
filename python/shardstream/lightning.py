"""PyTorch Lightning: exact mid-epoch resume on every rank.

Lightning saves the state of the train DataLoaders (``StatefulDataLoader``)
in its checkpoints, but the checkpoint is written by rank 0, so it holds
rank 0's state only, and every other rank refuses it on resume
(``StateMismatchError``: the state is for rank 0). ``ShardStreamCallback``
gathers every rank's loader states into the checkpoint and hands each rank
its own back when the run resumes. It also keeps the datasets' epoch at
Lightning's ``current_epoch``, so that a run restarted from a checkpoint
with a plain DataLoader streams Lightning's epoch, not epoch 0 again.

Lightning Fabric has no callbacks, and ``fabric.save`` under DDP writes
rank 0's objects only: ``all_rank_states(loader)`` (on every rank, before
``fabric.save``) is the loader state of every rank, and
``load_rank_state(loader, state)`` loads this rank's part of it.

``import shardstream.lightning`` imports ``lightning``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader

from .accelerate import RANK_STATES, rank_state
from .dataset import StreamingDataset
from .ledger import Ledger, sample_ids
from .mix import Mix
from .resplit import FrameworkWrapperError

__all__ = ["ShardStreamCallback", "all_rank_states", "load_rank_state"]

LEDGER_KEY = "shardstream_ledger"
"""The checkpoint entry where ``ShardStreamCallback`` keeps the ledger's resume step."""


class ShardStreamCallback(Callback):
    """Add it to ``Trainer(callbacks=[...])`` when training on
    ``StreamingDataset`` or ``Mix`` loaders under several ranks:

    - ``StatefulDataLoader``: a checkpoint holds the loader states of every
      rank (gathered when it is saved, a collective Lightning runs on every
      rank), and resuming from it gives each rank its own, so a run killed
      mid-epoch resumes exactly where each rank stopped. The checkpoint is
      resumed with the same world size (else ``StateMismatchError`` names
      ``shardstream.elastic_state``).
    - any DataLoader: each train epoch streams the dataset's epoch
      ``trainer.current_epoch`` (``set_epoch`` when the epoch starts, and,
      for the loaders given to ``trainer.fit``, when a run resumes from a
      checkpoint; a loader made in a ``train_dataloader()`` hook is made
      after the resume: call ``set_epoch(self.trainer.current_epoch)``
      there).
    - a ``StatefulDataLoader`` whose dataset has no ``len()``: raises
      ``FrameworkWrapperError`` when training starts (Lightning would read
      a batch ahead, and its checkpoints resume a batch late).
    - ``ledger_dir``: writes a ``shardstream.Ledger`` there (the train
      loader's ``StreamingDataset`` made with ``sample_ids=True``, its
      batches keeping ``__id__``): each train batch is recorded as a step
      when it starts, the end of an epoch after its last batch, and a
      checkpoint holds the step a run resumed from it records first, so
      that ``shardstream verify LEDGER_DIR`` checks the whole run, resumes
      included.
    """

    def __init__(self, ledger_dir: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        self.ledger_dir = ledger_dir
        self.ledger: Ledger | None = None
        self._resume_step: int | None = None

    def _open_ledger(self, trainer: Trainer) -> None:
        if self.ledger_dir is None or self.ledger is not None:
            return
        loaders = list(_loaders(trainer.train_dataloader))
        datasets = [getattr(loader, "dataset", None) for loader in loaders]
        if len(loaders) != 1 or not isinstance(datasets[0], StreamingDataset):
            kinds = ", ".join(type(d).__name__ for d in datasets) or "none"
            raise FrameworkWrapperError(
                f"ShardStreamCallback(ledger_dir=...) records one train loader over a "
                f"StreamingDataset; this run trains on {len(loaders)} ({kinds})"
            )
        workers = getattr(loaders[0], "num_workers", 0)
        self.ledger = Ledger(
            self.ledger_dir,
            datasets[0],
            resume_step=self._resume_step,
            num_workers=max(int(workers), 1),
        )

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check_no_read_ahead(trainer)
        self._open_ledger(trainer)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Recorded before the step, so that a checkpoint saved at the
        # step's end (ModelCheckpoint) finds it recorded.
        if self.ledger is not None:
            self.ledger.record(batch)

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.ledger is not None and batch_idx + 1 == trainer.num_training_batches:
            self.ledger.epoch_end(int(sample_ids(batch)[0, 0]))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None

    def _check_no_read_ahead(self, trainer: Trainer) -> None:
        # Lightning reads one batch ahead when the train loader has no
        # len(): the loader state a checkpoint holds is then a batch ahead
        # of training, and the resumed run would skip that batch.
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        if fetcher is None or getattr(fetcher, "length", 0) is not None:
            return
        if not getattr(fetcher, "prefetch_batches", 0):
            return
        for loader in _loaders(trainer.train_dataloader):
            dataset = loader.dataset if isinstance(loader, DataLoader) else None
            if isinstance(dataset, (StreamingDataset, Mix)) and hasattr(loader, "state_dict"):
                raise FrameworkWrapperError(
                    f"Lightning reads one batch ahead of training when the train loader has no "
                    f"len(), so the loader state in its checkpoints would be a batch ahead and a "
                    f"run resumed from one would skip a batch. Give the {type(dataset).__name__} "
                    "sample counts so that len() works (a manifest.json beside the shards, "
                    "written by `shardstream index`, or count_samples=True for local tar "
                    "shards); a Mix has no len(): resume it from checkpoints saved at epoch ends, "
                    "with a plain DataLoader"
                )

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _set_epoch(_loaders(trainer.train_dataloader), trainer.current_epoch)

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.ledger is not None:
            checkpoint[LEDGER_KEY] = {"resume_step": self.ledger.checkpoint()}
        fit_state = _fit_loop_state(checkpoint)
        states = fit_state.get("combined_loader") if fit_state is not None else None
        world_size = trainer.world_size
        if fit_state is None or not states or world_size <= 1:
            return
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, states)
        fit_state["combined_loader"] = [
            {"format": RANK_STATES, "world_size": world_size, "ranks": [g[i] for g in gathered]}
            for i in range(len(states))
        ]

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Runs before Lightning restores its loops and makes the first
        # iterator of the run (before any epoch hook): the loaders given
        # to fit() stream the epoch Lightning resumes at.
        resume_step = checkpoint.get(LEDGER_KEY, {}).get("resume_step")
        if isinstance(resume_step, int):
            self._resume_step = resume_step
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {})
        epoch = progress.get("current", {}).get("processed")
        source = getattr(trainer.fit_loop, "_data_source", None)
        if isinstance(epoch, int):
            _set_epoch(_loaders(getattr(source, "instance", None)), epoch)
        fit_state = _fit_loop_state(checkpoint)
        states = fit_state.get("combined_loader") if fit_state is not None else None
        if fit_state is None or not states:
            return
        fit_state["combined_loader"] = [
            rank_state(state, trainer.global_rank, trainer.world_size) for state in states
        ]


def all_rank_states(loader: Any) -> Any:
    """The ``state_dict()`` of ``loader`` (a ``StatefulDataLoader``, or what
    Fabric's ``setup_dataloaders`` made of one) on every rank, gathered: a
    collective, so call it on every rank, e.g. as the loader's entry of the
    state given to ``fabric.save`` (which writes rank 0's objects only).
    Without ``torch.distributed`` (or with one rank) it is the loader's own
    state. Resume with ``load_rank_state``."""
    state = _stateful_loader(loader, "all_rank_states").state_dict()
    world_size = _rank_and_world_size()[1]
    if world_size <= 1:
        return state
    states: list[Any] = [None] * world_size
    dist.all_gather_object(states, state)
    return {"format": RANK_STATES, "world_size": world_size, "ranks": states}


def load_rank_state(loader: Any, state: Any) -> None:
    """Loads this rank's part of ``state`` (an ``all_rank_states``, rank and
    world size from ``torch.distributed``) into ``loader``; any other loader
    state is loaded as it is. A state of another world size raises
    ``StateMismatchError`` naming ``shardstream.elastic_state``."""
    rank, world_size = _rank_and_world_size()
    own = rank_state(state, rank, world_size)
    _stateful_loader(loader, "load_rank_state").load_state_dict(own)


def _rank_and_world_size() -> tuple[int, int]:
    """This process's rank and the world size (0 and 1 outside
    ``torch.distributed``)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _stateful_loader(loader: Any, caller: str) -> Any:
    """``loader``, or the loader wrapped in it by Fabric's
    ``setup_dataloaders``, if it has ``state_dict`` and ``load_state_dict``."""
    inner = loader if hasattr(loader, "state_dict") else getattr(loader, "_dataloader", None)
    if not (hasattr(inner, "state_dict") and hasattr(inner, "load_state_dict")):
        raise TypeError(
            f"{caller} needs a loader with a state (torchdata.stateful_dataloader."
            f"StatefulDataLoader), got {type(loader).__name__}"
        )
    return inner


def _set_epoch(loaders: Iterator[Any], epoch: int) -> None:
    """``set_epoch(epoch)`` of the shardstream datasets of ``loaders``."""
    for loader in loaders:
        dataset = loader.dataset if isinstance(loader, DataLoader) else None
        if isinstance(dataset, (StreamingDataset, Mix)):
            dataset.set_epoch(epoch)


def _fit_loop_state(checkpoint: Mapping[str, Any]) -> dict[str, Any] | None:
    """The fit loop's own state in a Lightning checkpoint, where the loader
    states are (``loops.fit_loop.state_dict.combined_loader``)."""
    state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict")
    return state if isinstance(state, dict) else None


def _loaders(iterables: Any) -> Iterator[Any]:
    """The DataLoaders of Lightning's train iterables (one, or a list, tuple
    or dict of them, nested)."""
    if isinstance(iterables, Mapping):
        for value in iterables.values():
            yield from _loaders(value)
    elif isinstance(iterables, (list, tuple)):
        for value in iterables:
            yield from _loaders(value)
    elif iterables is not None:
        yield iterables

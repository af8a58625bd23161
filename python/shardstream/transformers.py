"""The Hugging Face ``Trainer`` over a ``StreamingDataset``.

``StreamingTrainer`` is ``transformers.Trainer`` with its train DataLoader
prepared by ``shardstream.accelerate.prepare_loader`` (the dataset splits the
data between ranks itself; Accelerate must not split it again), and, with
``ledger_dir``, the sample ledger written as it trains: each batch a step,
each epoch's end, and a ``shardstream_ledger.json`` in every checkpoint
folder, from which ``train(resume_from_checkpoint=...)`` continues the
ledger in a new generation. ``shardstream verify LEDGER_DIR`` then checks
the whole run, resumes included.

Importing this module imports ``transformers``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback  # type: ignore[import-untyped]
from transformers.trainer_utils import (  # type: ignore[import-untyped]
    PREFIX_CHECKPOINT_DIR,
    get_last_checkpoint,
)

from .accelerate import prepare_loader
from .dataset import StreamingDataset
from .ledger import Ledger

__all__ = ["LEDGER_FILE", "StreamingTrainer"]

LEDGER_FILE = "shardstream_ledger.json"
"""The file of a checkpoint folder that holds the step a run resumed from it records first."""


# How DataLoader workers start in a DDP rank: forked ones can hang as they
# start on CPython before 3.12 (gh-112275; docs/integrations.md), spawned
# ones cannot; from 3.12 on the default (fork) is safe.
_WORKER_START = "spawn" if sys.version_info < (3, 12) else None


class KeepSampleIds:
    """A ``collate_fn`` that hands ``collate`` the samples without their
    ``__id__`` and adds the ids to its batch (an ``int64`` tensor of
    ``(epoch, shard, index)`` rows), so that a collator written for the
    samples' fields never sees them. Picklable (spawned workers) when
    ``collate`` is."""

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, samples: list[dict[str, Any]]) -> Any:
        ids = [sample.pop("__id__") for sample in samples]
        batch = self.collate(samples)
        if not isinstance(batch, dict):
            raise TypeError(
                f"StreamingTrainer(ledger_dir=...) adds the sample ids to the collator's "
                f"batch, which must be a dict; the collator returned {type(batch).__name__}"
            )
        batch["__id__"] = torch.tensor(ids, dtype=torch.int64)
        return batch


class StreamingTrainer(Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` for a ``StreamingDataset`` as ``train_dataset``.

    Args:
        ledger_dir: writes a ``shardstream.Ledger`` there (the dataset made
            with ``sample_ids=True``; the ids are taken from the samples
            before ``data_collator`` sees them and from the batch before the
            model does). Every checkpoint folder gets ``shardstream_ledger.json``
            with the step a run resumed from it records first.
        Everything else as ``transformers.Trainer``.

    The train DataLoader is made from ``TrainingArguments``
    (``per_device_train_batch_size``, ``dataloader_num_workers``,
    ``dataloader_pin_memory``, ``dataloader_persistent_workers``,
    ``dataloader_prefetch_factor``) and prepared with
    ``prepare_loader``; ``multiprocessing_context`` is ``"spawn"`` when there
    are workers on CPython before 3.12 (forked workers can hang after a
    collective there; docs/integrations.md), the default from 3.12 on.
    """

    def __init__(
        self, *args: Any, ledger_dir: str | os.PathLike[str] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.ledger_dir = ledger_dir
        self.ledger: Ledger | None = None
        self._resume_from: str | None = None
        if ledger_dir is not None:
            dataset = self.train_dataset
            if not isinstance(dataset, StreamingDataset):
                raise TypeError(
                    f"StreamingTrainer(ledger_dir=...) records a StreamingDataset; "
                    f"train_dataset is {type(dataset).__name__}"
                )
            if not dataset.options["sample_ids"]:
                raise ValueError(
                    "StreamingTrainer(ledger_dir=...): the train_dataset hands out no sample "
                    "ids: create it with sample_ids=True for the ledger to record"
                )
            self.add_callback(_LedgerCallback(self))

    def get_train_dataloader(self) -> DataLoader:
        """The train loader over ``train_dataset``, prepared by ``prepare_loader``."""
        if self.train_dataset is None:
            raise ValueError("StreamingTrainer: training needs a train_dataset")
        args = self.args
        workers = args.dataloader_num_workers
        collate = self.data_collator
        if self.ledger_dir is not None:
            collate = KeepSampleIds(collate)
        loader = DataLoader(
            self.train_dataset,
            batch_size=self._train_batch_size,
            collate_fn=collate,
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=bool(workers and args.dataloader_persistent_workers),
            prefetch_factor=args.dataloader_prefetch_factor if workers else None,
            multiprocessing_context=_WORKER_START if workers else None,
        )
        return prepare_loader(self.accelerator, loader)

    def train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """``Trainer.train``; with a ledger, a resumed run continues it from the
        step the checkpoint's ``shardstream_ledger.json`` holds."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
        self._resume_from = (
            resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        )
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.close_ledger()

    def training_step(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """Records the batch's samples (and takes their ids out of the model's
        inputs), then ``Trainer.training_step``."""
        if self.ledger is not None:
            self.ledger.record({"__id__": inputs.pop("__id__")})
        return super().training_step(model, inputs, *args, **kwargs)

    def open_ledger(self) -> None:
        """Starts this run's ledger generation (at train begin, on every rank)."""
        if self.ledger_dir is None or self.ledger is not None:
            return
        resume_step = None
        if self._resume_from is not None:
            resume_step = _resume_step(Path(self._resume_from))
        dataset = self.train_dataset
        assert isinstance(dataset, StreamingDataset)  # checked at construction
        self.ledger = Ledger(
            self.ledger_dir,
            dataset,
            resume_step=resume_step,
            num_workers=max(self.args.dataloader_num_workers, 1),
        )

    def close_ledger(self) -> None:
        """Makes the ledger's records durable and closes it."""
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None


def _resume_step(checkpoint: Path) -> int:
    """The step a run resumed from ``checkpoint`` records first."""
    path = checkpoint / LEDGER_FILE
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"the checkpoint {checkpoint} holds no {LEDGER_FILE}: it was saved by a run "
            "without ledger_dir, so the ledger cannot continue from it; start a new ledger "
            "folder for this run"
        ) from None
    step = entry.get("resume_step") if isinstance(entry, Mapping) else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{path}: not {{'resume_step': int}}: {entry!r}")
    return step


class _LedgerCallback(TrainerCallback):  # type: ignore[misc]
    """The ledger's bookkeeping at train begin, epoch ends and checkpoints."""

    def __init__(self, trainer: StreamingTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.open_ledger()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ledger = self.trainer.ledger
        if ledger is not None and ledger.last_epoch is not None:
            ledger.epoch_end(ledger.last_epoch)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ledger = self.trainer.ledger
        if ledger is None:
            return
        step = ledger.checkpoint()
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            (folder / LEDGER_FILE).write_text(json.dumps({"resume_step": step}))

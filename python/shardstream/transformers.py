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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback  # type: ignore[import-untyped]
from transformers.trainer_utils import (  # type: ignore[import-untyped]
    PREFIX_CHECKPOINT_DIR,
    get_last_checkpoint,
)

from .accelerate import LoaderLedger, prepare_loader

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
        self.ledger: LoaderLedger | None = None
        if ledger_dir is not None:
            self.ledger = LoaderLedger(
                ledger_dir,
                self.train_dataset,
                self.args.dataloader_num_workers,
                owner="StreamingTrainer",
            )
            self.add_callback(_LedgerCallback(self.ledger))

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
        if self.ledger is not None:
            # A new generation at the first step: from the checkpoint's step
            # when resuming, else from step 0.
            self.ledger.close()
            self.ledger.resume_step = None
            if isinstance(resume_from_checkpoint, str):
                self.ledger.load_state_dict(_ledger_entry(Path(resume_from_checkpoint)))
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            if self.ledger is not None:
                self.ledger.close()

    def training_step(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """Records the batch's samples (and takes their ids out of the model's
        inputs), then ``Trainer.training_step``."""
        if self.ledger is not None:
            self.ledger.record({"__id__": inputs.pop("__id__")}, last=False)
        return super().training_step(model, inputs, *args, **kwargs)


def _ledger_entry(checkpoint: Path) -> Any:
    """The ledger's entry of ``checkpoint`` (``{"resume_step": int}``)."""
    try:
        return json.loads((checkpoint / LEDGER_FILE).read_text())
    except FileNotFoundError:
        raise ValueError(
            f"the checkpoint {checkpoint} holds no {LEDGER_FILE}: it was saved by a run "
            "without ledger_dir, so the ledger cannot continue from it; start a new ledger "
            "folder for this run"
        ) from None


class _LedgerCallback(TrainerCallback):  # type: ignore[misc]
    """The ledger's bookkeeping at epoch ends and checkpoints."""

    def __init__(self, ledger: LoaderLedger) -> None:
        self.ledger = ledger

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ledger.epoch_end()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        entry = self.ledger.state_dict()  # on every rank: durable
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            (folder / LEDGER_FILE).write_text(json.dumps(entry))

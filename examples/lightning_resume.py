"""PyTorch Lightning DDP over a ``StreamingDataset``, killed mid-epoch and
resumed exactly on every rank.

``shardstream.lightning.ShardStreamCallback`` puts every rank's
``StatefulDataLoader`` state in Lightning's checkpoints (Lightning alone
keeps rank 0's, which the other ranks refuse) and keeps the dataset's
epoch at Lightning's::

    python examples/make_dataset.py /tmp/shards --shards 8 --samples-per-shard 12
    torchrun --standalone --nproc_per_node 2 examples/lightning_resume.py /tmp/shards \\
        --out /tmp/pl --kill-at 17        # killed at step 17; last.ckpt is step 15's
    torchrun --standalone --nproc_per_node 2 examples/lightning_resume.py /tmp/shards \\
        --out /tmp/pl --resume /tmp/pl/ckpt/last.ckpt

(``python examples/lightning_resume.py ...`` without torchrun starts the two
CPU processes itself, Lightning's own launcher.) Each rank appends one JSON
line per training step to ``OUT/steps-rank{rank}.jsonl``: ``{"step",
"epoch", "keys"}``, written before the step, so a killed run leaves the
steps it trained on.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from shardstream import StreamingDataset

if TYPE_CHECKING:
    import lightning.pytorch as pl

# How DataLoader workers start in a DDP rank: forked ones can hang as they
# start on CPython before 3.12 (gh-112275; docs/integrations.md), spawned
# ones cannot; from 3.12 on the default (fork) is safe.
WORKER_START = "spawn" if sys.version_info < (3, 12) else None


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stand-in features (byte counts of the fields) and a target from the key."""
    features, targets = [], []
    for sample in samples:
        sizes = [len(v) for k, v in sorted(sample.items()) if not k.startswith("__")]
        features.append([len(sizes) / 4, sum(sizes) / 65536, sizes[0] / 65536])
        targets.append([zlib.crc32(sample["__key__"].encode()) % 1000 / 1000])
    return {
        "keys": [s["__key__"] for s in samples],
        "features": torch.tensor(features),
        "targets": torch.tensor(targets),
    }


def make_model(out: Path, kill_at: int | None) -> pl.LightningModule:
    """The model. Lightning is imported here, not at the top: the spawned
    DataLoader workers import this script (to find ``collate``), and need
    not import Lightning too."""
    import lightning.pytorch as pl

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
            step = self.trainer.global_step + 1
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no last checkpoint
            line = {"step": step, "epoch": self.current_epoch, "keys": batch["keys"]}
            with open(out / f"steps-rank{self.global_rank}.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
            prediction = self.layer(batch["features"])
            return torch.nn.functional.mse_loss(prediction, batch["targets"])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Model()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Lightning DDP resume over shardstream.")
    parser.add_argument("data", help="dataset spec (directory, brace pattern, paths)")
    parser.add_argument("--out", type=Path, required=True, help="steps and checkpoints go here")
    parser.add_argument("--epochs", type=int, default=2, help="epochs (default: 2)")
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--kill-at", type=int, help="SIGKILL every rank at this step")
    parser.add_argument("--resume", type=Path, help="a checkpoint to resume from")
    parser.add_argument(
        "--plain-loader",
        action="store_true",
        help="a torch DataLoader (no mid-epoch state: resume from epoch-end checkpoints)",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from shardstream.lightning import ShardStreamCallback

    dataset = StreamingDataset(args.data, seed=0, shuffle_buffer=16)
    loader_class = DataLoader if args.plain_loader else StatefulDataLoader
    loader = loader_class(
        dataset,
        batch_size=4,
        num_workers=args.num_workers,
        collate_fn=collate,
        # Workers forked from a DDP rank can hang at start on CPython before
        # 3.12 (gh-112275): Lightning's collective just before the fork may
        # leave a gloo thread holding the interpreter's thread-state lock.
        # Spawned workers start from a fresh interpreter, so they cannot
        # inherit it.
        multiprocessing_context=WORKER_START if args.num_workers else None,
        # Spawned workers start once, not at every epoch (each imports
        # torch anew); epochs advance in them by themselves.
        persistent_workers=args.num_workers > 0,
    )
    checkpoints = ModelCheckpoint(
        dirpath=args.out / "ckpt",
        save_last=True,
        save_top_k=-1,
        every_n_train_steps=None if args.plain_loader else args.every,
        every_n_epochs=1 if args.plain_loader else None,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=args.epochs,
        callbacks=[checkpoints, ShardStreamCallback()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(make_model(args.out, args.kill_at), loader, ckpt_path=args.resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())

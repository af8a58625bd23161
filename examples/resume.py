"""Checkpoint a training loop mid-epoch and resume it exactly, with
``torchdata``'s ``StatefulDataLoader`` over a ``StreamingDataset``.

A checkpoint is one JSON file holding the loader's state (which carries the
``StreamingDataset`` state of every DataLoader worker), the model's weights,
the step, and the sample keys consumed so far. Resuming from it yields the
rest of the epoch in exactly the order the uninterrupted run would have.

Simulate a crash after 5 batches, then resume::

    python examples/make_dataset.py /tmp/shards --shards 4 --samples-per-shard 16
    python examples/resume.py /tmp/shards --save-at 5 --state /tmp/ckpt.json --kill \\
        --keys-out /tmp/before.json
    python examples/resume.py /tmp/shards --resume /tmp/ckpt.json --keys-out /tmp/after.json

``--keys-out`` gets the keys *this run* consumed, in order (with ``--kill``
it is written, like the checkpoint, just before the process kills itself),
so ``before + after`` is one uninterrupted epoch. Resume with the same data,
``--seed``, ``--batch-size`` and ``--num-workers``: a state of other data or
options is refused with ``shardstream.StateMismatchError``.

Checkpoints are written atomically (a temporary file, ``fsync``, then
``os.replace``), so a crash while saving leaves the previous one intact.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from toy_batch import FEATURES, collate

from shardstream import StreamingDataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train for one epoch, checkpoint mid-epoch, resume exactly."
    )
    parser.add_argument(
        "data", help="dataset spec: directory, brace pattern (quote it), path or file:// URL"
    )
    parser.add_argument("--batch-size", type=int, default=4, help="samples per batch (default: 4)")
    parser.add_argument(
        "--num-workers", type=int, default=2, help="DataLoader workers (default: 2)"
    )
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (default: 0)")
    parser.add_argument("--epoch", type=int, default=0, help="epoch to train (default: 0)")
    parser.add_argument(
        "--shuffle-buffer", type=int, default=64, help="shuffle buffer in samples (default: 64)"
    )
    parser.add_argument(
        "--save-at",
        type=int,
        metavar="K",
        help="write a checkpoint to --state after K batches of this run",
    )
    parser.add_argument("--state", type=Path, help="checkpoint file written by --save-at")
    parser.add_argument(
        "--kill",
        action="store_true",
        help="SIGKILL this process right after the --save-at checkpoint (simulates a crash)",
    )
    parser.add_argument("--resume", type=Path, metavar="PATH", help="checkpoint to resume from")
    parser.add_argument(
        "--keys-out", type=Path, help="write the sample keys this run consumed (JSON list)"
    )
    args = parser.parse_args(argv)
    if args.save_at is not None and (args.state is None or args.save_at < 0):
        parser.error("--save-at K needs K >= 0 and --state PATH")
    if args.kill and args.save_at is None:
        parser.error("--kill needs --save-at")
    return args


# --------------------------------------------------------------------------
# Data and model
# --------------------------------------------------------------------------


def make_loader(args: argparse.Namespace) -> StatefulDataLoader:
    dataset = StreamingDataset(args.data, seed=args.seed, shuffle_buffer=args.shuffle_buffer)
    dataset.set_epoch(args.epoch)
    return StatefulDataLoader(
        dataset,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        collate_fn=collate,
        timeout=120 if args.num_workers > 0 else 0,
    )


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> float:
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(batch["features"]), batch["targets"])
    loss.backward()
    optimizer.step()
    return float(loss.detach())


# --------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------


def write_json_atomically(path: Path, payload: Any) -> None:
    """Writes ``payload`` as JSON to ``path``: a temporary file beside it,
    flushed and fsynced, then renamed over ``path`` (and the directory fsynced)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def save_checkpoint(
    path: Path, loader: StatefulDataLoader, model: torch.nn.Module, step: int, keys: list[str]
) -> None:
    write_json_atomically(
        path,
        {
            "state": loader.state_dict(),
            "keys": keys,
            "step": step,
            "model": {name: t.tolist() for name, t in model.state_dict().items()},
        },
    )


def restore_checkpoint(path: Path, loader: StatefulDataLoader, model: torch.nn.Module) -> int:
    """Loads the loader state and weights from ``path``; returns its step."""
    checkpoint = json.loads(path.read_text())
    loader.load_state_dict(checkpoint["state"])
    model.load_state_dict({name: torch.tensor(v) for name, v in checkpoint["model"].items()})
    return int(checkpoint["step"])


# --------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # stateless: nothing to save
    loader = make_loader(args)
    step = restore_checkpoint(args.resume, loader, model) if args.resume else 0
    first_step = step

    keys: list[str] = []  # consumed by this run

    def checkpoint_if_due() -> None:
        if args.save_at is None or step - first_step != args.save_at:
            return
        save_checkpoint(args.state, loader, model, step, keys)
        if args.keys_out:
            write_json_atomically(args.keys_out, keys)
        print(f"step {step}: checkpoint -> {args.state}", flush=True)
        if args.kill:
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint_if_due()
    loss = float("nan")
    for batch in loader:
        loss = train_step(model, optimizer, batch)
        keys.extend(batch["keys"])
        step += 1
        checkpoint_if_due()

    if args.save_at is not None and step - first_step < args.save_at:
        print(f"error: the epoch ended after {step - first_step} batches", file=sys.stderr)
        return 2
    if args.keys_out:
        write_json_atomically(args.keys_out, keys)
    print(f"done: {step - first_step} batches, {len(keys)} samples, last loss {loss:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

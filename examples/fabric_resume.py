"""Lightning Fabric DDP over a ``StreamingDataset``, killed mid-epoch and
resumed exactly on every rank.

``fabric.save`` writes rank 0's objects only, so a loader given to it as it
is comes back as rank 0's state, which the other ranks refuse on resume
(``StateMismatchError``: the state is for rank 0).
``shardstream.lightning.all_rank_states`` gathers every rank's loader state
for the checkpoint and ``load_rank_state`` loads each rank's own::

    python examples/make_dataset.py /tmp/shards --shards 8 --samples-per-shard 12
    torchrun --standalone --nproc_per_node 2 examples/fabric_resume.py /tmp/shards \\
        --out /tmp/fabric --kill-at 17    # killed at step 17; last.ckpt is step 15's
    torchrun --standalone --nproc_per_node 2 examples/fabric_resume.py /tmp/shards \\
        --out /tmp/fabric2 --resume /tmp/fabric/ckpt/last.ckpt

(``python examples/fabric_resume.py ...`` without torchrun starts the two
CPU processes itself, Fabric's own launcher.) Each rank appends one JSON
line per training step to ``OUT/steps-rank{rank}.jsonl``: ``{"step",
"epoch", "keys"}``, written before the step, so a killed run leaves the
steps it trained on. ``--ledger DIR`` (in every run of a job) writes the
sample ledger, which ``shardstream verify DIR`` checks across the kill and
the resume. ``--loader-as-is`` puts the loader itself in Fabric's
state instead, as for any other stateful object: rank 1 then refuses the
resume.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import zlib
from pathlib import Path
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from shardstream import Ledger, StreamingDataset

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
    batch = {
        "keys": [s["__key__"] for s in samples],
        "features": torch.tensor(features),
        "targets": torch.tensor(targets),
    }
    if "__id__" in samples[0]:  # sample_ids=True: what the ledger records
        batch["__id__"] = torch.tensor([s["__id__"] for s in samples])
    return batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Lightning Fabric DDP resume over shardstream.")
    parser.add_argument("data", help="dataset spec (directory, brace pattern, paths)")
    parser.add_argument("--out", type=Path, required=True, help="steps and checkpoints go here")
    parser.add_argument("--epochs", type=int, default=2, help="epochs (default: 2)")
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--kill-at", type=int, help="SIGKILL every rank at this step")
    parser.add_argument("--resume", type=Path, help="a checkpoint to resume from")
    parser.add_argument("--ledger", type=Path, help="write the sample ledger there")
    parser.add_argument(
        "--loader-as-is",
        action="store_true",
        help="save the loader itself in Fabric's state (rank 0's state only: no exact resume)",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    # Imported here, not at the top: spawned DataLoader workers import this
    # script again, and need torch, not Lightning (3 s of CPU each).
    from lightning.fabric import Fabric

    from shardstream.lightning import all_rank_states, load_rank_state

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    dataset = StreamingDataset(
        args.data, seed=0, shuffle_buffer=16, sample_ids=args.ledger is not None
    )
    loader = fabric.setup_dataloaders(
        StatefulDataLoader(
            dataset,
            batch_size=4,
            num_workers=args.num_workers,
            collate_fn=collate,
            multiprocessing_context=WORKER_START if args.num_workers else None,
            # Spawned workers start once, not at every epoch (each imports
            # torch and Lightning anew); epochs advance in them by themselves.
            persistent_workers=args.num_workers > 0,
        )
    )

    step = first_epoch = 0
    if args.resume:
        state = {"model": model, "optimizer": optimizer}
        if args.loader_as_is:
            state["loader"] = loader  # Fabric loads the saved (rank 0's) state into it
        remainder = fabric.load(args.resume, state)
        if not args.loader_as_is:
            load_rank_state(loader, remainder["loader"])
        step, first_epoch = remainder["step"], remainder["epoch"]
    # A new generation from the checkpoint's step (a collective: every rank).
    ledger = None
    if args.ledger is not None:
        workers = max(args.num_workers, 1)
        ledger = Ledger(args.ledger, dataset, resume_step=step, num_workers=workers)

    for epoch in range(first_epoch, args.epochs):
        dataset.set_epoch(epoch)  # a resumed epoch keeps its loaded state
        for batch in ledger.track(loader) if ledger is not None else loader:
            step += 1
            if step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no last checkpoint
            line = {"step": step, "epoch": epoch, "keys": batch["keys"]}
            with open(args.out / f"steps-rank{fabric.global_rank}.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
            loss = torch.nn.functional.mse_loss(model(batch["features"]), batch["targets"])
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            if step % args.every == 0:
                if ledger is not None:
                    ledger.checkpoint()  # durable up to this step, the resume step
                # On every rank: all_rank_states is a collective, and so is fabric.save.
                loader_state = loader if args.loader_as_is else all_rank_states(loader)
                checkpoint = {"model": model, "optimizer": optimizer, "loader": loader_state}
                fabric.save(
                    args.out / "ckpt" / "last.ckpt", {**checkpoint, "step": step, "epoch": epoch}
                )
    if ledger is not None:
        ledger.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A DistributedDataParallel training loop over shardstream, under torchrun.

DDP all-reduces gradients in every backward pass, so every rank must run
the same number of steps: a rank with one batch more waits forever for the
others. With sample counts (a manifest written by ``shardstream index``, or,
for local tar shards, their headers, counted when the dataset is created)
every rank of a ``StreamingDataset`` gets exactly ``len(dataset)`` samples, and with the
same number of DataLoader workers, the same number of batches, even when the
shards hold very different numbers of samples and with ``drop_last=False``.

Index the shards once (optional for local plain tar shards), then launch
(CPU and ``gloo`` are enough)::

    python examples/make_dataset.py /tmp/shards --shards 6 --samples-per-shard 20
    shardstream index /tmp/shards -o /tmp/shards/manifest.json
    torchrun --standalone --nproc_per_node 2 examples/ddp_torchrun.py /tmp/shards \\
        --out /tmp/ddp-out --num-workers 2 --batch-size 4 --epochs 2

or on two machines (here: two launches on one)::

    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 --master_addr 127.0.0.1 \\
        --master_port 29500 examples/ddp_torchrun.py /tmp/shards --out /tmp/ddp-out
    torchrun --nnodes 2 --node_rank 1 --nproc_per_node 2 --master_addr 127.0.0.1 \\
        --master_port 29500 examples/ddp_torchrun.py /tmp/shards --out /tmp/ddp-out

Each rank writes ``OUT/rank-{rank}.json``::

    {"rank": 0, "world_size": 2, "local_rank": 0, "num_workers": 2, "batch_size": 4,
     "remainder": "drop", "samples_per_rank": 43,
     "epochs": [{"epoch": 0, "batches": 12, "min_batches": 12, "max_batches": 12,
                 "keys": ["sample-000003-000000", ...]}, ...]}

``min_batches``/``max_batches`` come from an all-reduce of every rank's
batch count after each epoch; the exit status is 1 if they differ.
The backend is ``nccl`` when CUDA is available, else ``gloo``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from toy_batch import FEATURES, collate

from shardstream import StreamingDataset

# How DataLoader workers start in a DDP rank: forked ones can hang as they
# start on CPython before 3.12 (gh-112275; docs/integrations.md), spawned
# ones cannot; from 3.12 on the default (fork) is safe.
WORKER_START = "spawn" if sys.version_info < (3, 12) else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="DDP training over shardstream: equal batches on every rank."
    )
    parser.add_argument(
        "data",
        help="dataset spec (directory, brace pattern, paths) with a manifest.json beside it",
    )
    parser.add_argument("--out", type=Path, required=True, help="where to write rank-{rank}.json")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per batch (default: 4)")
    parser.add_argument(
        "--num-workers", type=int, default=2, help="DataLoader workers per rank (default: 2)"
    )
    parser.add_argument("--epochs", type=int, default=1, help="epochs to train (default: 1)")
    parser.add_argument(
        "--remainder",
        choices=["drop", "pad"],
        default="drop",
        help="samples that do not divide among ranks: drop them or pad (default: drop)",
    )
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (default: 0)")
    parser.add_argument(
        "--shuffle-buffer", type=int, default=64, help="shuffle buffer in samples (default: 64)"
    )
    parser.add_argument(
        "--manifest", help="manifest path (default: the manifest.json beside the shards)"
    )
    return parser.parse_args(argv)


def batch_count_range(batches: int, device: torch.device) -> tuple[int, int]:
    """The fewest and most batches any rank ran (one all-reduce)."""
    counts = torch.tensor([batches, -batches], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    return -int(counts[1]), int(counts[0])


def write_json_atomically(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def train(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dataset = StreamingDataset(
        args.data,
        seed=args.seed,
        shuffle_buffer=args.shuffle_buffer,
        remainder=args.remainder,
        manifest=args.manifest,
    )
    # Every rank gets len(dataset) samples: the counts come from the manifest,
    # or from the headers of local tar shards (the dataset refuses to start
    # when neither gives them, rather than let DDP hang).
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        collate_fn=collate,
        drop_last=False,
        persistent_workers=False,
        timeout=300 if args.num_workers > 0 else 0,
        # Workers forked from a DDP rank can hang at start on CPython before
        # 3.12 (gh-112275): a gloo thread finishing the collective just
        # before the fork (the batch count of the last epoch, DDP's first
        # broadcast) may hold the interpreter's thread-state lock, which the
        # child then waits for forever. Spawned workers start from a fresh
        # interpreter.
        multiprocessing_context=WORKER_START if args.num_workers > 0 else None,
    )
    torch.manual_seed(0)  # DDP broadcasts rank 0's weights anyway
    model = torch.nn.Linear(FEATURES, 1).to(device)
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)

    epochs = []
    for epoch in range(args.epochs):
        dataset.set_epoch(epoch)
        batches, keys, loss = 0, [], torch.tensor(float("nan"))
        for batch in loader:
            optimizer.zero_grad()
            prediction = ddp(batch["features"].to(device))
            loss = torch.nn.functional.mse_loss(prediction, batch["targets"].to(device))
            loss.backward()  # all-reduces gradients with every other rank
            optimizer.step()
            batches += 1
            keys.extend(batch["keys"])
        fewest, most = batch_count_range(batches, device)
        epochs.append(
            {
                "epoch": epoch,
                "batches": batches,
                "min_batches": fewest,
                "max_batches": most,
                "loss": float(loss.detach()),
                "keys": keys,
            }
        )
        print(
            f"rank {rank}/{world_size} epoch {epoch}: {batches} batches, {len(keys)} samples "
            f"(batches on all ranks: {fewest}..{most})",
            flush=True,
        )
    return {
        "rank": rank,
        "world_size": world_size,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "num_workers": args.num_workers,
        "batch_size": args.batch_size,
        "remainder": args.remainder,
        "samples_per_rank": len(dataset),
        "epochs": epochs,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if torch.cuda.is_available():
        backend = "nccl"
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend)
    try:
        record = train(args, device)
        write_json_atomically(args.out / f"rank-{record['rank']}.json", record)
        dist.barrier()
        unequal = [e["epoch"] for e in record["epochs"] if e["min_batches"] != e["max_batches"]]
        if unequal:
            print(f"error: ranks ran different numbers of batches in epochs {unequal}")
            return 1
        if record["rank"] == 0:
            print(f"ok: {record['world_size']} ranks, equal batches in every epoch", flush=True)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

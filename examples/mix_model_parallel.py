"""A weighted mixture under torchrun with model-parallel groups.

Each group of ``--model-parallel-size`` consecutive ranks (a tensor- or
context-parallel group) receives the same batches in the same order; the
groups split each stream between them. Every rank writes what it read to
``OUT_DIR/rank-N.json``::

    torchrun --nproc_per_node 4 examples/mix_model_parallel.py \\
        "a/shard-{000000..000009}.tar" "b/shard-{000000..000004}.tar" out/ \\
        --weights 0.7 0.3 --model-parallel-size 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from shardstream import Mix, StreamingDataset

# How DataLoader workers start in a DDP rank: forked ones can hang as they
# start on CPython before 3.12 (gh-112275; docs/integrations.md), spawned
# ones cannot; from 3.12 on the default (fork) is safe.
WORKER_START = "spawn" if sys.version_info < (3, 12) else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+", help="one dataset spec per stream, then OUT_DIR")
    parser.add_argument("--weights", type=float, nargs="+", help="one weight per stream")
    parser.add_argument("--policy", default="stop", choices=["stop", "restart", "continue"])
    parser.add_argument("--model-parallel-size", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epoch", type=int, default=0)
    args = parser.parse_args(argv)
    if len(args.specs) < 2:
        parser.error("give at least one spec and OUT_DIR")
    *args.specs, out_dir = args.specs
    args.out_dir = Path(out_dir)
    return args


def stream_key(sample: dict) -> str:
    """The stream's directory and the sample's key: unique across streams."""
    return f"{Path(sample['__url__']).parent.name}/{sample['__key__']}"


def collate_keys(samples: list[dict]) -> list[str]:
    """A batch as its samples' stream keys."""
    return [stream_key(s) for s in samples]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        streams = [
            StreamingDataset(spec, seed=args.seed, model_parallel_size=args.model_parallel_size)
            for spec in args.specs
        ]
        mix = Mix(streams, args.weights, policy=args.policy, seed=args.seed)
        mix.set_epoch(args.epoch)
        loader = DataLoader(
            mix,
            batch_size=args.batch_size,
            num_workers=args.workers,
            collate_fn=collate_keys,
            multiprocessing_context=WORKER_START if args.workers else None,
        )
        batches = [batch for batch in loader]
        # Every rank reaches this collective: no rank ran out early.
        count = torch.tensor([len(batches)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        data_rank, data_world = streams[0].distributed_slot()
        record = {
            "rank": rank,
            "data_parallel_rank": data_rank,
            "data_parallel_size": data_world,
            "batches": batches,
            "max_batches": int(count.item()),
        }
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / f"rank-{rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps(record))
        os.replace(path.with_suffix(".tmp"), path)
        print(f"rank {rank}: data-parallel rank {data_rank}, {len(batches)} batches", flush=True)
        dist.barrier()
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())

"""Check, on the cluster where training runs, that ``StreamingDataset``
splits a dataset across DDP ranks and DataLoader workers: every sample read
exactly once per epoch, and every rank the same number of samples.

It ships in the package, so an installed wheel runs it with torchrun's
``-m`` (CPU and the ``gloo`` backend are enough)::

    torchrun --standalone --nproc_per_node 2 -m shardstream.ddp_check \
        'data/train/shard-{000000..000127}.tar' /tmp/ddp-out

or over S3 (here an S3-compatible server on loopback)::

    torchrun --standalone --nproc_per_node 2 -m shardstream.ddp_check \
        s3://bucket/shards/ /tmp/ddp-out --s3-endpoint-url http://127.0.0.1:9000

Each rank joins the process group, builds ``StreamingDataset(DATA_SPEC)``
*without* passing ``rank``/``world_size`` (they come from
``torch.distributed``), reads one epoch through a ``DataLoader`` with
``--workers`` worker processes (started with ``spawn``, which a fork right
after a collective cannot hang; they count in the rank's ``stats()``) and
``batch_size=None``, and writes what it saw to ``OUT_DIR/rank-{rank}.json``::

    {"rank": 0, "world_size": 2, "num_workers": 2, "epoch": 0,
     "keys": ["sample-000003-000000", ...], "stats": {...}}

After a barrier, rank 0 reads every rank's file and checks that no key was
read by two ranks (or twice by one) and that every rank read as many samples
as the others; the exit status is 1 if not. Whether the union is the whole
dataset is for the caller to check, since only the caller knows the dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch.distributed as dist
from torch.utils.data import DataLoader

from shardstream import S3Config, StreamingDataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Read one epoch on every DDP rank and record the sample keys."
    )
    parser.add_argument(
        "data_spec",
        help="dataset spec: path, brace range (quote it), file:// URL, directory or s3:// URL",
    )
    parser.add_argument("out_dir", type=Path, help="where to write rank-{rank}.json")
    parser.add_argument(
        "--workers", type=int, default=2, help="DataLoader workers per rank (default: 2)"
    )
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (default: 0)")
    parser.add_argument("--epoch", type=int, default=0, help="epoch to read (default: 0)")
    parser.add_argument(
        "--backend", default="gloo", help="torch.distributed backend (default: gloo)"
    )
    parser.add_argument(
        "--manifest",
        help="a manifest written by `shardstream index` (default: manifest.json beside the shards)",
    )
    parser.add_argument(
        "--s3-endpoint-url",
        help="for s3:// specs: an S3-compatible endpoint, addressed path-style",
    )
    return parser.parse_args(argv)


def read_epoch(args: argparse.Namespace) -> dict:
    """This rank's share of one epoch: its keys, in the order it read them."""
    s3 = (
        S3Config(endpoint_url=args.s3_endpoint_url, path_style=True)
        if args.s3_endpoint_url
        else None
    )
    dataset = StreamingDataset(args.data_spec, seed=args.seed, s3=s3, manifest=args.manifest)
    dataset.set_epoch(args.epoch)
    # Spawned workers: a fork right after the process group's collectives
    # can hang (CPython gh-112275, see docs/integrations.md).
    context = "spawn" if args.workers > 0 else None
    loader = DataLoader(
        dataset, batch_size=None, num_workers=args.workers, multiprocessing_context=context
    )
    keys = [sample["__key__"] for sample in loader]
    rank, world_size = dataset.distributed_slot()
    if (rank, world_size) != (dist.get_rank(), dist.get_world_size()):
        raise RuntimeError(f"dataset saw rank {rank} of {world_size}, not the process group's")
    return {
        "rank": rank,
        "world_size": world_size,
        "num_workers": args.workers,
        "epoch": args.epoch,
        "keys": keys,
        "stats": dataset.stats(),
    }


def check_records(out_dir: Path, world_size: int) -> list[str]:
    """What is wrong across all ranks' files: keys read more than once, and
    ranks that read another number of samples than rank 0."""
    counts: Counter[str] = Counter()
    lengths = []
    for rank in range(world_size):
        record = json.loads((out_dir / f"rank-{rank}.json").read_text())
        counts.update(record["keys"])
        lengths.append(len(record["keys"]))
    problems = []
    repeated = sorted(key for key, n in counts.items() if n > 1)
    if repeated:
        problems.append(f"{len(repeated)} keys read more than once: {repeated[:5]}")
    if len(set(lengths)) > 1:
        problems.append(f"ranks read unequal numbers of samples: {lengths}")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group(args.backend)
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        record = read_epoch(args)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / f"rank-{rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
        print(f"rank {rank}/{world_size}: {len(record['keys'])} samples -> {path}", flush=True)
        dist.barrier()
        status = 0
        if rank == 0:
            problems = check_records(args.out_dir, world_size)
            for problem in problems:
                print(f"error: {problem}", flush=True)
            if problems:
                status = 1
            else:
                print(f"ok: {world_size} ranks read disjoint samples, as many each", flush=True)
        return status
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

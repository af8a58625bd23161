"""What an epoch boundary costs the training loop: several epochs of a
local dataset through a DataLoader whose consumer stands for a training
step (a fixed sleep per batch, so that the loader keeps up within an
epoch), with ``persistent_workers`` off and on, at each worker count.

    python benches/epoch_boundary_bench.py --out bench-results \\
        [--workers 2 4] [--epochs 4] [--step-ms 5] [--start-method fork]

For each boundary the stall is the time from the end of the step on an
epoch's last batch to the first batch of the next epoch (creating the
iterator included): what the loop waits that it does not wait within an
epoch (the median wait for a batch inside epochs is given beside it). Each
configuration runs in a fresh process; medians over the boundaries of
``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

from mix_bench import write_stream  # benches/, the directory of this script


def run(spec: str, workers: int, persistent: bool, args: Any) -> dict[str, Any]:
    """Several epochs in this process: each boundary's stall and the waits
    for a batch within epochs (seconds)."""
    from torch.utils.data import DataLoader

    from shardstream import StreamingDataset

    dataset = StreamingDataset(spec, seed=0)
    loader = DataLoader(
        dataset,
        batch_size=args.batch,
        num_workers=workers,
        collate_fn=list,
        persistent_workers=persistent,
        multiprocessing_context=args.start_method,
    )
    step = args.step_ms / 1000
    stalls, waits, samples, touched = [], [], 0, 0
    step_end = None
    for _ in range(args.epochs):
        first = True
        iterator = iter(loader)
        while True:
            asked = time.perf_counter()
            batch = next(iterator, None)
            got = time.perf_counter()
            if batch is None:
                break
            if first and step_end is not None:
                stalls.append(got - step_end)
            elif not first:
                waits.append(got - asked)
            first = False
            # The consumer touches every byte it is handed.
            for sample in batch:
                touched = zlib.crc32(sample["bin"], touched)
            samples += len(batch)
            time.sleep(step)
            step_end = time.perf_counter()
    return {"stalls": stalls, "waits": waits, "samples": samples, "crc32": touched}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=5.0, help="the training step per batch")
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--per-shard", type=int, default=256)
    parser.add_argument("--size", type=int, default=20_000, help="bytes per sample")
    parser.add_argument(
        "--start-method", default="fork", choices=multiprocessing.get_all_start_methods()
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.epochs < 2 or args.repeats < 1 or min(args.workers) < 1:
        parser.error("--epochs must be at least 2, --repeats and --workers at least 1")
    if args.child:
        spec, workers, persistent = args.child
        print(json.dumps(run(spec, int(workers), persistent == "1", args)))
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.out) as work:
        spec = write_stream(Path(work) / "data", "s", args.shards, args.per_shard, args.size)
        for workers in args.workers:
            for persistent in (False, True):
                stalls, waits = [], []
                for _ in range(args.repeats):
                    child = [sys.executable, __file__, *(argv or sys.argv[1:])]
                    child += ["--child", spec, str(workers), "1" if persistent else "0"]
                    done = subprocess.run(
                        child, capture_output=True, text=True, timeout=1800, check=True
                    )
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    expected = args.shards * args.per_shard * args.epochs
                    if result["samples"] != expected:
                        raise SystemExit(f"read {result['samples']} samples, not {expected}")
                    stalls += result["stalls"]
                    waits += result["waits"]
                row = {
                    "workers": workers,
                    "persistent_workers": persistent,
                    "boundaries": len(stalls),
                    "stall_ms_median": 1000 * statistics.median(stalls),
                    "stall_ms_max": 1000 * max(stalls),
                    # No wait within epochs of one batch.
                    "wait_ms_within_epochs": 1000 * statistics.median(waits) if waits else 0.0,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    (args.out / "epoch_boundary_bench.json").write_text(json.dumps(rows, indent=2))
    lines = [
        f"{args.shards} shards x {args.per_shard} samples of {args.size:,} bytes, batch "
        f"{args.batch}, a {args.step_ms:g} ms step per batch, {args.epochs} epochs, "
        f"{args.repeats} runs, {args.start_method} workers",
        "",
        "| workers | persistent_workers | boundary stall, median (max) | wait for a batch "
        "within epochs, median |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workers']} | {r['persistent_workers']} | {r['stall_ms_median']:.1f} ms "
            f"({r['stall_ms_max']:.1f}) | {r['wait_ms_within_epochs']:.2f} ms |"
        )
    (args.out / "epoch_boundary_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

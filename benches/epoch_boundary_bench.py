"""What an epoch boundary costs the training loop: several epochs of a
local dataset through a DataLoader whose consumer stands for a training
step (a fixed sleep per batch, so that the loader keeps up within an
epoch), with ``persistent_workers`` off and on, at each worker count
(workers 0: the main process reads the data).

    python benches/epoch_boundary_bench.py --out bench-results \\
        [--workers 0 2 4] [--epochs 4] [--step-ms 5] [--start-method fork] \\
        [--epoch-end-ms 200] [--s3-first-byte-ms 20] [--mix] [--no-early-start] [--jpeg]

``--s3-first-byte-ms`` reads the shards from a local S3 server (moto)
behind ``tests/python/fault_proxy.py``, each answer that late and each
connection at 100 MB/s, instead of from local files. ``--mix`` reads a
``shardstream.Mix`` of two streams (each half of the shards, equal weights,
``policy="continue"``) instead of one dataset. ``--no-early-start`` makes
the datasets with ``read_next_epoch_early=False``. ``--jpeg`` reads JPEGs of
500x375 (``augment_bench.make_dataset``) decoded by ``Image(224, flip=0.5)``
in batches of ``--batch`` made in Rust (``batch_size``, the DataLoader's
``batch_size=None``) instead of samples of ``--size`` bytes: a next epoch
whose first batch costs its decode.

For each boundary the stall is the time from the end of the step on an
epoch's last batch (and of ``--epoch-end-ms``, the loop's own work between
epochs) to the first batch of the next epoch (creating the iterator
included): what the loop waits that it does not wait within an epoch (the
median wait for a batch inside epochs is given beside it). Each
configuration runs in a fresh process; medians over the boundaries of
``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from augment_bench import make_dataset  # benches/, the directory of this script
from mix_bench import write_stream

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))
from fault_proxy import Faults, running_fault_proxy
from s3_server import BUCKET, TEST_KEY_ID, TEST_SECRET, running_s3_server

S3_BANDWIDTH = 100e6
"""Bytes per second of each connection through the proxy."""


def run(spec: str, workers: int, persistent: bool, args: Any) -> dict[str, Any]:
    """Several epochs in this process: each boundary's stall and the waits
    for a batch within epochs (seconds)."""
    from torch.utils.data import DataLoader

    from shardstream import Mix, S3Config, StreamingDataset

    s3 = None
    if args.endpoint:
        s3 = S3Config(endpoint_url=args.endpoint, region="us-east-1", path_style=True)
    early = not args.no_early_start
    options: dict[str, Any] = {"seed": 0, "read_next_epoch_early": early}
    if args.jpeg:
        from shardstream import Image

        options.update(decode={"jpg": Image(224, flip=0.5)}, batch_size=args.batch)
    dataset: Any = StreamingDataset(spec, s3=s3, **options)
    if args.mix:
        halves = [spec_of(spec, 0, args.shards // 2), spec_of(spec, args.shards // 2, args.shards)]
        streams = [StreamingDataset(half, **options) for half in halves]
        dataset = Mix(streams, [1.0, 1.0], policy="continue")
    loader = DataLoader(
        dataset,
        batch_size=None if args.jpeg else args.batch,
        num_workers=workers,
        collate_fn=None if args.jpeg else list,
        persistent_workers=persistent,
        multiprocessing_context=args.start_method if workers else None,
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
                # What the loop does between epochs (evaluation, a checkpoint).
                time.sleep(args.epoch_end_ms / 1000)
                step_end = time.perf_counter()
                break
            if first and step_end is not None:
                stalls.append(got - step_end)
            elif not first:
                waits.append(got - asked)
            first = False
            # The consumer touches every byte it is handed.
            if args.jpeg:
                images = batch["jpg"].numpy()
                touched = zlib.crc32(images.tobytes(), touched)
                samples += len(images)
            else:
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
    parser.add_argument(
        "--epoch-end-ms",
        type=float,
        default=0.0,
        help="the loop's own work between epochs (evaluation, a checkpoint)",
    )
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--per-shard", type=int, default=256)
    parser.add_argument("--size", type=int, default=20_000, help="bytes per sample")
    parser.add_argument(
        "--start-method", default="fork", choices=multiprocessing.get_all_start_methods()
    )
    parser.add_argument(
        "--s3-first-byte-ms",
        type=float,
        help="read from a local S3 server behind a proxy answering this late",
    )
    parser.add_argument(
        "--mix", action="store_true", help="a Mix of two streams (local files only)"
    )
    parser.add_argument(
        "--no-early-start",
        action="store_true",
        help="read_next_epoch_early=False: each epoch's streams open at its iteration",
    )
    parser.add_argument(
        "--jpeg",
        action="store_true",
        help="JPEGs decoded by Image(224) in Rust batches of --batch (--size unused)",
    )
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.epochs < 2 or args.repeats < 1 or min(args.workers) < 0:
        parser.error("--epochs must be at least 2, --repeats at least 1, --workers at least 0")
    if args.mix and (args.s3_first_byte_ms is not None or args.shards < 2):
        parser.error("--mix reads local files, at least 2 shards")
    if args.jpeg and (args.mix or args.s3_first_byte_ms is not None):
        parser.error("--jpeg reads one dataset of local files")
    if args.child:
        spec, workers, persistent = args.child
        print(json.dumps(run(spec, int(workers), persistent == "1", args)))
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, AWS_ACCESS_KEY_ID=TEST_KEY_ID, AWS_SECRET_ACCESS_KEY=TEST_SECRET)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.out) as work, ExitStack() as stack:
        if args.jpeg:
            root = Path(work) / "data"
            make_dataset(root, args.shards, args.per_shard, jobs=os.cpu_count() or 1)
            spec = str(root)
        else:
            spec = write_stream(Path(work) / "data", "s", args.shards, args.per_shard, args.size)
        endpoint = []
        if args.s3_first_byte_ms is not None:
            spec, endpoint = serve_on_s3(stack, spec, args.s3_first_byte_ms / 1000)
        for workers in args.workers:
            # Persistent workers need workers.
            for persistent in (False, True) if workers else (False,):
                stalls, waits = [], []
                for _ in range(args.repeats):
                    child = [sys.executable, __file__, *(argv or sys.argv[1:]), *endpoint]
                    child += ["--child", spec, str(workers), "1" if persistent else "0"]
                    done = subprocess.run(
                        child, capture_output=True, text=True, timeout=1800, check=True, env=env
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
    where = "local files, a Mix of two streams" if args.mix else "local files"
    if args.s3_first_byte_ms is not None:
        where = (
            f"S3 (moto) behind a proxy: {args.s3_first_byte_ms:g} ms to the first byte, "
            f"{S3_BANDWIDTH / 1e6:.0f} MB/s per connection"
        )
    samples = "500x375 JPEGs decoded by Image(224)" if args.jpeg else f"{args.size:,} bytes"
    lines = [
        f"{args.shards} shards x {args.per_shard} samples of {samples} ({where}), "
        f"batch {args.batch}, a {args.step_ms:g} ms step per batch, {args.epoch_end_ms:g} ms "
        f"of the loop's own between epochs, {args.epochs} epochs, "
        f"{args.repeats} runs, {args.start_method} workers, read_next_epoch_early "
        f"{not args.no_early_start}",
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


def spec_of(spec: str, first: int, end: int) -> str:
    """The brace spec of shards ``first..end - 1`` of ``write_stream``'s
    ``spec`` (``DIR/s-{0000..NNNN}.tar``)."""
    return spec.split("{")[0] + f"{{{first:04d}..{end - 1:04d}}}.tar"


def serve_on_s3(stack: ExitStack, spec: str, first_byte: float) -> tuple[str, list[str]]:
    """Uploads the local shards of ``spec`` (one directory's) to a local S3
    server behind a proxy answering ``first_byte`` seconds late: their
    ``s3://`` spec and the child's ``--endpoint`` argument."""
    server = stack.enter_context(running_s3_server())
    client = server.client()
    client.create_bucket(Bucket=BUCKET)
    for path in sorted(Path(spec).parent.glob("*.tar")):
        client.upload_file(str(path), BUCKET, f"boundary/{path.name}")
    faults = Faults(first_byte_delay=first_byte, bandwidth=S3_BANDWIDTH)
    proxy = stack.enter_context(running_fault_proxy(server.endpoint_url, faults))
    return f"s3://{BUCKET}/boundary/", ["--endpoint", proxy.endpoint_url]


if __name__ == "__main__":
    raise SystemExit(main())

"""The cost of mixing: samples/s of two local streams read one after the
other as plain ``StreamingDataset`` objects, and of the same two streams as
a ``Mix`` (in the main process, no DataLoader; medians of ``--repeats``)::

    python benches/mix_bench.py --samples 100000 --size 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

from shardstream import Mix, StreamingDataset


def write_stream(root: Path, name: str, shards: int, per_shard: int, size: int) -> str:
    root.mkdir(parents=True)
    payload = b"x" * size
    for shard in range(shards):
        with tarfile.open(root / f"{name}-{shard:04d}.tar", "w") as tar:
            for i in range(per_shard):
                info = tarfile.TarInfo(f"{name}{shard:04d}-{i:07d}.bin")
                info.size = size
                tar.addfile(info, BytesIO(payload))
    return str(root / f"{name}-{{0000..{shards - 1:04d}}}.tar")


def rate(make, repeats: int) -> tuple[float, int]:
    rates, count = [], 0
    for epoch in range(repeats):
        datasets = make()
        start = time.perf_counter()
        count = 0
        for ds in datasets:
            ds.set_epoch(epoch)
            for _ in ds:
                count += 1
        rates.append(count / (time.perf_counter() - start))
    return statistics.median(rates), count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000, help="samples per stream")
    parser.add_argument("--size", type=int, default=200, help="bytes per sample")
    parser.add_argument("--shards", type=int, default=8, help="shards per stream")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        per_shard = args.samples // args.shards
        specs = [
            write_stream(Path(tmp) / name, name, args.shards, per_shard, args.size)
            for name in ("a", "b")
        ]
        options = {"seed": 1, "shuffle_buffer": 1000, "count_samples": True}

        def plain():
            return [StreamingDataset(spec, **options) for spec in specs]

        def mixed():
            streams = [StreamingDataset(spec, **options) for spec in specs]
            return [Mix(streams, [0.5, 0.5], policy="continue")]

        for name, make in (("plain, one after the other", plain), ("Mix (continue)", mixed)):
            samples_per_s, count = rate(make, args.repeats)
            print(f"{name:28s} {count:8d} samples  {samples_per_s:10,.0f} samples/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

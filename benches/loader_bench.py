"""Loader benchmark behind `make bench`: samples/s, MB/s and peak RSS of one
epoch through a torch DataLoader, for the example audio dataset at
num_workers 0 and 2; peak RSS for the same 4 GB of data cut into 64 MB,
1 GB and 4 GB shards (memory must not grow with shard size); and the cost of
a mid-epoch resume (bytes read beyond one uninterrupted epoch).

    python benches/loader_bench.py --out bench-results [--repeats 3] [--memory-rows-mb 4096]

Each measurement runs in a fresh subprocess, so page cache is warm (the
dataset is read once before timing) but no Python state is shared. Peak RSS
is the subprocess's own maximum RSS, and for DataLoader workers the largest
worker's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

from child_run import run_child  # noqa: E402
from make_dataset import make_dataset  # noqa: E402


def run_epoch(spec: str, num_workers: int) -> dict[str, float]:
    """One epoch in this process; returns the measurements."""
    from torch.utils.data import DataLoader

    from shardstream import StreamingDataset

    dataset = StreamingDataset(spec, seed=0, shuffle_buffer=1000)
    loader = DataLoader(dataset, batch_size=32, num_workers=num_workers, collate_fn=list)
    start = time.perf_counter()
    samples = sum(len(batch) for batch in loader)
    elapsed = time.perf_counter() - start
    stats = dataset.stats()
    return {
        "samples": samples,
        "seconds": elapsed,
        "bytes": stats["bytes_read"],
        "rss_main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


def measure(spec: str, num_workers: int) -> dict[str, float]:
    """Runs `run_epoch` in a fresh subprocess."""
    return run_child(__file__, [spec, str(num_workers)])


def resume_cost(spec: str, manifest: bool) -> dict[str, float]:
    """Stops an epoch halfway, resumes it from the saved state, and measures
    the bytes both runs read beyond what one uninterrupted epoch reads."""
    from shardstream import StreamingDataset

    def dataset() -> StreamingDataset:
        use = None if manifest else False
        return StreamingDataset(spec, seed=0, shuffle_buffer=100, manifest=use)

    whole = dataset()
    total = sum(1 for _ in whole)
    uninterrupted = whole.stats()["bytes_read"]
    first = dataset()
    stream = iter(first)
    for _ in range(total // 2):
        next(stream)
    state = first.state_dict()
    del stream
    time.sleep(0.5)
    resumed = dataset()
    resumed.load_state_dict(state)
    rest = sum(1 for _ in resumed)
    assert total // 2 + rest == total, (total, rest)
    extra = first.stats()["bytes_read"] + resumed.stats()["bytes_read"] - uninterrupted
    return {"held": len(state["buffer"]), "extra_mb": extra / 1e6, "epoch_mb": uninterrupted / 1e6}


def write_large_shards(directory: Path, total_mb: int, shard_mb: int) -> list[Path]:
    """`total_mb` MB of 1 MiB samples in shards of `shard_mb` MB each."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard, first in enumerate(range(0, total_mb, shard_mb)):
        path = directory / f"big-{shard:06d}.tar"
        write_large_shard(path, range(first, min(first + shard_mb, total_mb)))
        paths.append(path)
    return paths


def write_large_shard(path: Path, samples: range) -> None:
    """A shard of 1 MiB `.bin` members with a small `.json` each, one sample
    per number in `samples` (which names it)."""
    block = bytes(range(256)) * 4096
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in samples:
            for name, data in ((f"big-{i:08d}.bin", block), (f"big-{i:08d}.json", b"{}")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, _Reader(data))


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.data) if n < 0 else self.pos + n
        chunk, self.pos = self.data[self.pos : end], min(end, len(self.data))
        return chunk


def warm(paths: list[Path]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--samples-per-shard", type=int, default=64)
    parser.add_argument(
        "--memory-rows-mb", type=int, default=4096, help="data size of the memory rows"
    )
    parser.add_argument("--child", nargs=2, metavar=("SPEC", "WORKERS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_epoch(args.child[0], int(args.child[1]))))
        return

    data = args.out / "audio"
    shards = make_dataset(data, shards=args.shards, samples_per_shard=args.samples_per_shard)
    warm(shards)
    spec = str(data / f"shard-{{000000..{args.shards - 1:06d}}}.tar")
    rows = []
    for workers in (0, 2):
        runs = [measure(spec, workers) for _ in range(args.repeats)]
        seconds = statistics.median(r["seconds"] for r in runs)
        first = runs[0]
        rows.append(
            (
                f"audio, {args.shards} shards x {args.samples_per_shard}",
                workers,
                first["samples"] / seconds,
                first["bytes"] / 1e6 / seconds,
                max(r["rss_main_mb"] for r in runs),
                max(r["rss_worker_mb"] for r in runs),
            )
        )

    total_mb = args.memory_rows_mb
    for shard_mb in sorted({64, 1024, total_mb} & set(range(1, total_mb + 1))):
        directory = args.out / f"large-{shard_mb}mb-shards"
        paths = write_large_shards(directory, total_mb, shard_mb)
        warm(paths)
        result = measure(str(directory), 0)
        shutil.rmtree(directory)
        rows.append(
            (
                f"{total_mb} MB in {len(paths)} x {shard_mb} MB shards",
                0,
                result["samples"] / result["seconds"],
                result["bytes"] / 1e6 / result["seconds"],
                result["rss_main_mb"],
                result["rss_worker_mb"],
            )
        )

    from shardstream._core import run_cli

    manifest_path = data / "manifest.json"
    assert run_cli(["shardstream", "index", spec, "-o", str(manifest_path)]) == 0
    resume_rows = [(m, resume_cost(spec, m)) for m in (False, True)]
    manifest_path.unlink()

    header = "| dataset | num_workers | samples/s | MB/s | peak RSS (MB) | peak RSS worker (MB) |"
    lines = [header, "|---|---|---|---|---|---|"]
    for name, workers, sps, mbps, rss_main, rss_worker in rows:
        worker = f"{rss_worker:,.0f}" if workers else "-"
        lines.append(
            f"| {name} | {workers} | {sps:,.0f} | {mbps:,.0f} | {rss_main:,.0f} | {worker} |"
        )
    lines += [
        "",
        "| resume at half an epoch | samples in the shuffle buffer | bytes read beyond one epoch |",
        "|---|---|---|",
    ]
    for manifest, cost in resume_rows:
        how = "with manifest (range reads)" if manifest else "without manifest"
        lines.append(
            f"| {how} | {cost['held']} | {cost['extra_mb']:.1f} MB "
            f"({100 * cost['extra_mb'] / cost['epoch_mb']:.1f}% of {cost['epoch_mb']:.0f} MB) |"
        )
    machine = f"{os.cpu_count()} cores, Python {sys.version.split()[0]}"
    table = "\n".join(lines)
    print(f"{machine}, median of {args.repeats} runs (memory rows: one run)\n{table}")
    (args.out / "loader_bench.md").write_text(f"{machine}\n\n{table}\n")


if __name__ == "__main__":
    main()

"""Cache benchmark: one epoch over shards read from their cached copies
(``cache_dir=``), served first by a local HTTP server on 127.0.0.1.
Reports per epoch the wall time, the bytes the process read through
``read()`` (``rchar`` of ``/proc/self/io``) and those it read from storage
(``read_bytes``), and ``stats()["cache_bytes"]``; it stops if a copy was
fetched again (a check that failed).

    python benches/cache_bench.py --out /tmp/cache-bench [--shards 16] [--shard-mb 16] [--epochs 5]

``--cold`` drops the cached copies from the page cache (``posix_fadvise``
``DONTNEED``) before each epoch, so that ``read_bytes`` counts the bytes
read from the disk.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "python"))

from http_server import running_http_server  # noqa: E402

from shardstream import StreamingDataset  # noqa: E402

SAMPLE_BYTES = 64 << 10


def io_counters() -> dict[str, int]:
    """This process's ``/proc/self/io`` counters."""
    lines = Path("/proc/self/io").read_text().splitlines()
    return {k: int(v) for k, v in (line.split(": ") for line in lines)}


def make_shards(root: Path, shards: int, shard_mb: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    per_shard = (shard_mb << 20) // SAMPLE_BYTES
    for s in range(shards):
        path = root / f"shard-{s:06d}.tar"
        if path.exists():
            continue
        with tarfile.open(path, "w") as tar:
            for i in range(per_shard):
                data = os.urandom(SAMPLE_BYTES)
                info = tarfile.TarInfo(f"{s:04d}-{i:06d}.bin")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def drop_from_page_cache(cache: Path) -> None:
    for path in cache.glob("*.shard"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--shard-mb", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--cold", action="store_true")
    args = parser.parse_args()
    data = args.out / "data"
    make_shards(data, args.shards, args.shard_mb)
    cache = args.out / "cache"
    for old in cache.glob("*"):
        old.unlink()
    total = args.shards * args.shard_mb << 20
    with running_http_server(data) as server:
        ds = StreamingDataset(server.shard_spec(args.shards), cache_dir=str(cache))
        for _ in ds:  # fills the cache
            pass
        times = []
        for epoch in range(args.epochs):
            if args.cold:
                drop_from_page_cache(cache)
            server.reset()
            before, stats_before = io_counters(), ds.stats()["cache_bytes"]
            start = time.perf_counter()
            samples = sum(1 for _ in ds)
            seconds = time.perf_counter() - start
            after, stats_after = io_counters(), ds.stats()["cache_bytes"]
            if server.served.gets:
                raise SystemExit(f"epoch {epoch} fetched {server.served.gets} shards again")
            times.append(seconds)
            print(
                f"epoch {epoch}: {samples} samples, {seconds:.3f} s, "
                f"{total / seconds / 1e6:.0f} MB/s, "
                f"rchar {(after['rchar'] - before['rchar']) / total:.2f}x the shards, "
                f"read_bytes {(after['read_bytes'] - before['read_bytes']) / total:.2f}x, "
                f"stats cache_bytes {(stats_after - stats_before) / total:.2f}x"
            )
    print(f"median {statistics.median(times):.3f} s ({total >> 20} MiB of cached shards)")


if __name__ == "__main__":
    main()

"""HTTP benchmark behind `make bench`: one epoch of the example audio shards
served over HTTP on loopback (tests/python/http_server.py), read by
shardstream and by webdataset (which fetches http URLs with curl) from the
same URLs, interleaved in one run.

    python benches/http_bench.py --out bench-results [--repeats 3]

Two network profiles: the server as it is, and behind the proxy of
tests/python/fault_proxy.py adding a first-byte delay to every GET and
capping each connection's bandwidth, as a remote server would. Every reader
runs in a fresh subprocess with num_workers 0 and a DataLoader of batch 32
(collate keeps the samples as they are); the table shows medians. One row
times a second epoch with `cache_dir=`, the first (untimed) having filled it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent / "tests" / "python"))

from child_run import run_child  # noqa: E402
from fault_proxy import Faults, running_fault_proxy  # noqa: E402
from http_server import running_http_server  # noqa: E402
from make_dataset import make_dataset  # noqa: E402

READERS = ["shardstream", "shardstream-parts", "shardstream-cached", "webdataset"]
LABELS = {
    "shardstream": "shardstream, one GET per shard",
    "shardstream-parts": "shardstream, 4 shards x 1 MiB ranged GETs",
    "shardstream-cached": "shardstream, epoch 2 with `cache_dir` (epoch 1 filled it)",
    "webdataset": "webdataset (curl)",
}
CHILD_TIMEOUT = 1800


def shardstream_dataset(urls: list[str], parts: bool, **options: Any) -> Any:
    """A dataset over `urls`: one GET per shard, or parallel ranged GETs."""
    from shardstream import StreamingDataset

    s3 = {"part_size": 1 << 20, "max_concurrency": 4} if parts else {"max_concurrency": 1}
    return StreamingDataset(urls, s3=s3, seed=0, shuffle_buffer=0, shuffle_shards=False, **options)


def shardstream_samples(dataset: Any) -> Iterator[int]:
    """Sample sizes from a shardstream dataset, through a DataLoader."""
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=32, num_workers=0, collate_fn=list)
    for batch in loader:
        for sample in batch:
            yield sum(len(v) for k, v in sample.items() if not k.startswith("__"))


def webdataset_samples(urls: list[str]) -> Iterator[int]:
    """Sample sizes from webdataset over the same URLs (curl)."""
    import webdataset as wds
    from torch.utils.data import DataLoader

    dataset = wds.WebDataset(urls, shardshuffle=False, empty_check=False)
    loader = DataLoader(dataset, batch_size=32, num_workers=0, collate_fn=list)
    for batch in loader:
        for sample in batch:
            yield sum(len(v) for k, v in sample.items() if not k.startswith("__"))


def run_reader(reader: str, urls: list[str]) -> dict[str, float]:
    """Times one epoch; imports happen before the clock starts."""
    import torch  # noqa: F401
    import webdataset  # noqa: F401

    import shardstream  # noqa: F401

    cache = tempfile.TemporaryDirectory(prefix="http-bench-cache-")
    cached = shardstream_dataset(urls, parts=False, cache_dir=cache.name)
    samples: Callable[[], Iterator[int]] = {
        "shardstream": lambda: shardstream_samples(shardstream_dataset(urls, parts=False)),
        "shardstream-parts": lambda: shardstream_samples(shardstream_dataset(urls, parts=True)),
        "shardstream-cached": lambda: shardstream_samples(cached),
        "webdataset": lambda: webdataset_samples(urls),
    }[reader]
    if reader == "shardstream-cached":
        for _ in shardstream_samples(cached):  # epoch 1 fills the cache, untimed
            pass
    start = time.perf_counter()
    count = total = 0
    for size in samples():
        count += 1
        total += size
    seconds = time.perf_counter() - start
    cache.cleanup()
    return {"samples": count, "bytes": total, "seconds": seconds}


def measure(reader: str, urls: list[str]) -> dict[str, float]:
    """Runs `run_reader` in a fresh subprocess."""
    return run_child(__file__, [reader, json.dumps(urls)], timeout=CHILD_TIMEOUT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--samples-per-shard", type=int, default=48)
    parser.add_argument("--first-byte-ms", type=float, default=20.0)
    parser.add_argument("--bandwidth-mb", type=float, default=25.0, help="MB/s per connection")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        reader, urls = args.child
        print(json.dumps(run_reader(reader, json.loads(urls))))
        return

    paths = make_dataset(
        args.out / "http-audio", shards=args.shards, samples_per_shard=args.samples_per_shard
    )
    dataset_mb = sum(p.stat().st_size for p in paths) / 1e6
    latency = Faults(first_byte_delay=args.first_byte_ms / 1000, bandwidth=args.bandwidth_mb * 1e6)
    profiles = {
        "direct": None,
        f"{args.first_byte_ms:.0f} ms first byte, {args.bandwidth_mb:.0f} MB/s per connection": (
            latency
        ),
    }
    rows = []
    with ExitStack() as stack:
        server = stack.enter_context(running_http_server(paths[0].parent))
        for profile, faults in profiles.items():
            base = server.base_url
            if faults is not None:
                base = stack.enter_context(running_fault_proxy(base, faults)).endpoint_url
            urls = [f"{base}/{p.name}" for p in paths]
            runs: dict[str, list[dict[str, float]]] = {r: [] for r in READERS}
            for _ in range(args.repeats):
                for reader in READERS:
                    runs[reader].append(measure(reader, urls))
            counts = {r: {run["samples"] for run in runs[r]} for r in READERS}
            if len({c for values in counts.values() for c in values}) != 1:
                raise SystemExit(f"readers disagree on the sample count: {counts}")
            for reader in READERS:
                seconds = statistics.median(run["seconds"] for run in runs[reader])
                first = runs[reader][0]
                rows.append(
                    (profile, reader, first["samples"] / seconds, first["bytes"] / 1e6 / seconds)
                )

    lines = ["| network | reader | samples/s | MB/s |", "|---|---|---|---|"]
    for profile, reader, sps, mbps in rows:
        lines.append(f"| {profile} | {LABELS[reader]} | {sps:,.0f} | {mbps:,.1f} |")
    machine = (
        f"{os.cpu_count()} cores, Python {sys.version.split()[0]}, "
        f"{len(paths)} shards, {dataset_mb:.0f} MB, median of {args.repeats} runs"
    )
    table = "\n".join(lines)
    print(f"{machine}\n{table}")
    (args.out / "http_bench.md").write_text(f"{machine}\n\n{table}\n")


if __name__ == "__main__":
    main()

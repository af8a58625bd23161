"""S3 benchmark behind `make bench`: one epoch of the example audio shards
from a real S3-compatible server on loopback (moto's), read by shardstream,
by a plain boto3 streaming GET per shard (parsed with `tarfile`), and by
webdataset (which fetches http URLs with curl), interleaved in one run;
and `shardstream index` of the same prefix (8 shards at once, and one at a
time), whose MB/s are the shards' stored bytes read, to compare with the
readers' field bytes.

    python benches/s3_bench.py --out bench-results [--repeats 3]
    python benches/s3_bench.py --shards 4 --samples-per-shard 1000 \
        --readers shardstream,boto3,webdataset --workers 0,2 --profiles direct

Two network profiles: the server as it is, and behind a proxy
(tests/python/fault_proxy.py) that adds a first-byte delay to every GET and
caps each connection's bandwidth, as a remote store would. Every reader
runs in a fresh subprocess with a DataLoader of batch 32 (collate keeps the
samples as they are) at each of `--workers` (num_workers; boto3 and the
index are one process whatever the count); the table shows medians, and
shardstream's GETs per shard (`stats()["requests"]`, at workers 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent / "tests" / "python"))

from child_run import run_child  # noqa: E402
from fault_proxy import Faults, running_fault_proxy  # noqa: E402
from make_dataset import make_dataset  # noqa: E402
from s3_server import BUCKET, TEST_KEY_ID, TEST_SECRET, running_s3_server  # noqa: E402

PREFIX = "bench/"
READERS = ["shardstream", "shardstream-parts", "boto3", "webdataset", "index", "index-1-job"]
CHILD_TIMEOUT = 1800


def shardstream_samples(
    endpoint: str, keys: list[str], parts: bool, workers: int, stats: dict[str, int]
) -> Iterator[int]:
    """Sample sizes from shardstream's prefix listing, through a DataLoader;
    the dataset's counters into `stats` at the end (workers 0 only)."""
    from torch.utils.data import DataLoader

    from shardstream import S3Config, StreamingDataset

    options = {"part_size": 1 << 20, "max_concurrency": 4} if parts else {}
    config = S3Config(endpoint_url=endpoint, region="us-east-1", path_style=True, **options)
    dataset = StreamingDataset(f"s3://{BUCKET}/{PREFIX}", s3=config, seed=0, shuffle_buffer=0)
    loader = DataLoader(dataset, batch_size=32, num_workers=workers, collate_fn=list)
    for batch in loader:
        for sample in batch:
            yield sum(len(v) for k, v in sample.items() if not k.startswith("__"))
    if workers == 0:
        stats.update(dataset.stats())


def boto3_client(endpoint: str):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=TEST_KEY_ID,
        aws_secret_access_key=TEST_SECRET,
    )


def boto3_samples(endpoint: str, keys: list[str]) -> Iterator[int]:
    """Sample sizes from one streaming GET per shard, grouped by key."""
    client = boto3_client(endpoint)
    for key in keys:
        body = client.get_object(Bucket=BUCKET, Key=key)["Body"]
        current, size = None, 0
        with tarfile.open(fileobj=body, mode="r|") as tar:
            for member in tar:
                if not member.isreg():
                    continue
                stem = member.name.split(".", 1)[0]
                data = tar.extractfile(member)
                assert data is not None
                length = len(data.read())
                if stem != current and current is not None:
                    yield size
                    size = 0
                current, size = stem, size + length
        if current is not None:
            yield size


def webdataset_samples(endpoint: str, keys: list[str], workers: int) -> Iterator[int]:
    """Sample sizes from webdataset over the same objects (presigned URLs)."""
    import webdataset as wds
    from torch.utils.data import DataLoader

    client = boto3_client(endpoint)
    urls = [
        client.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": key})
        for key in keys
    ]
    dataset = wds.WebDataset(urls, shardshuffle=False, empty_check=False)
    loader = DataLoader(dataset, batch_size=32, num_workers=workers, collate_fn=list)
    for batch in loader:
        for sample in batch:
            yield sum(len(v) for k, v in sample.items() if not k.startswith("__"))


def index_samples(endpoint: str, jobs: int) -> Iterator[int]:
    """``shardstream index`` of the prefix (no journal left: a fresh output
    each run); each shard's stored size, spread over its sample count."""
    import tempfile

    from shardstream import _core

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "manifest.json"
        cli = ["shardstream", "--s3-endpoint-url", endpoint, "--s3-path-style"]
        cli += ["--s3-region", "us-east-1", "index", f"s3://{BUCKET}/{PREFIX}"]
        if _core.run_cli([*cli, "--jobs", str(jobs), "-o", str(out)]) != 0:
            raise SystemExit("shardstream index failed")
        for shard in json.loads(out.read_text())["shards"]:
            for _ in range(shard["samples"]):
                yield shard["size"] // max(shard["samples"], 1)


def run_reader(reader: str, endpoint: str, keys: list[str], workers: int) -> dict[str, float]:
    """Times one epoch; imports happen before the clock starts."""
    import boto3  # noqa: F401
    import torch  # noqa: F401
    import webdataset  # noqa: F401

    import shardstream  # noqa: F401

    stats: dict[str, int] = {}
    samples: Callable[[], Iterator[int]] = {
        "shardstream": lambda: shardstream_samples(endpoint, keys, False, workers, stats),
        "shardstream-parts": lambda: shardstream_samples(endpoint, keys, True, workers, stats),
        "boto3": lambda: boto3_samples(endpoint, keys),
        "webdataset": lambda: webdataset_samples(endpoint, keys, workers),
        "index": lambda: index_samples(endpoint, jobs=8),
        "index-1-job": lambda: index_samples(endpoint, jobs=1),
    }[reader]
    start = time.perf_counter()
    count = total = 0
    for size in samples():
        count += 1
        total += size
    seconds = time.perf_counter() - start
    requests = stats.get("requests", 0) / max(len(keys), 1)
    return {"samples": count, "bytes": total, "seconds": seconds, "requests": requests}


def measure(reader: str, endpoint: str, keys: list[str], workers: int) -> dict[str, float]:
    """Runs `run_reader` in a fresh subprocess."""
    env = dict(os.environ, AWS_ACCESS_KEY_ID=TEST_KEY_ID, AWS_SECRET_ACCESS_KEY=TEST_SECRET)
    child = [reader, endpoint, json.dumps(keys), str(workers)]
    return run_child(__file__, child, env=env, timeout=CHILD_TIMEOUT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--samples-per-shard", type=int, default=48)
    parser.add_argument("--first-byte-ms", type=float, default=20.0)
    parser.add_argument("--bandwidth-mb", type=float, default=25.0, help="MB/s per connection")
    parser.add_argument(
        "--readers", default=",".join(READERS), help=f"comma-separated, of {', '.join(READERS)}"
    )
    parser.add_argument("--workers", default="0", help="comma-separated num_workers, e.g. 0,2")
    parser.add_argument(
        "--profiles", default="direct,latency", help="comma-separated, of direct, latency"
    )
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        reader, endpoint, keys, workers = args.child
        print(json.dumps(run_reader(reader, endpoint, json.loads(keys), int(workers))))
        return
    readers = [r for r in args.readers.split(",") if r]
    unknown = sorted(set(readers) - set(READERS))
    if unknown:
        parser.error(f"--readers: unknown {', '.join(unknown)}")
    worker_counts = [int(w) for w in args.workers.split(",") if w]
    chosen = set(args.profiles.split(","))
    if not chosen <= {"direct", "latency"}:
        parser.error(f"--profiles: unknown {', '.join(sorted(chosen - {'direct', 'latency'}))}")

    paths = make_dataset(
        args.out / "s3-audio", shards=args.shards, samples_per_shard=args.samples_per_shard
    )
    dataset_mb = sum(p.stat().st_size for p in paths) / 1e6
    latency = Faults(first_byte_delay=args.first_byte_ms / 1000, bandwidth=args.bandwidth_mb * 1e6)
    latency_name = (
        f"{args.first_byte_ms:.0f} ms first byte, {args.bandwidth_mb:.0f} MB/s per connection"
    )
    profiles = {
        name: faults
        for key, name, faults in [("direct", "direct", None), ("latency", latency_name, latency)]
        if key in chosen
    }
    rows = []
    with ExitStack() as stack:
        server = stack.enter_context(running_s3_server())
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        keys = [f"{PREFIX}{p.name}" for p in paths]
        for path, key in zip(paths, keys, strict=True):
            client.upload_file(str(path), BUCKET, key)
        for profile, faults in profiles.items():
            endpoint = server.endpoint_url
            if faults is not None:
                endpoint = stack.enter_context(
                    running_fault_proxy(server.endpoint_url, faults)
                ).endpoint_url
            cells = [(r, w) for w in worker_counts for r in readers]
            runs: dict[tuple[str, int], list[dict[str, float]]] = {c: [] for c in cells}
            for _ in range(args.repeats):
                for reader, workers in cells:
                    runs[reader, workers].append(measure(reader, endpoint, keys, workers))
            counts = {f"{r}/{w}": {run["samples"] for run in runs[r, w]} for r, w in cells}
            if len({c for values in counts.values() for c in values}) != 1:
                raise SystemExit(f"readers disagree on the sample count: {counts}")
            for reader, workers in cells:
                seconds = statistics.median(run["seconds"] for run in runs[reader, workers])
                first = runs[reader, workers][0]
                gets = (
                    first["requests"] if reader.startswith("shardstream") and workers == 0 else None
                )
                rows.append(
                    (
                        profile,
                        reader,
                        workers,
                        first["samples"] / seconds,
                        first["bytes"] / 1e6 / seconds,
                        gets,
                    )
                )

    lines = [
        "| network | reader | workers | samples/s | MB/s | GETs per shard |",
        "|---|---|---|---|---|---|",
    ]
    for profile, reader, workers, sps, mbps, gets in rows:
        per_shard = "" if gets is None else f"{gets:,.1f}"
        lines.append(
            f"| {profile} | {reader} | {workers} | {sps:,.0f} | {mbps:,.1f} | {per_shard} |"
        )
    machine = (
        f"{os.cpu_count()} cores, Python {sys.version.split()[0]}, "
        f"{len(paths)} shards, {dataset_mb:.0f} MB, median of {args.repeats} runs"
    )
    table = "\n".join(lines)
    print(f"{machine}\n{table}")
    (args.out / "s3_bench.md").write_text(f"{machine}\n\n{table}\n")


if __name__ == "__main__":
    main()

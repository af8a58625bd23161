"""S3 writer benchmark: MB/s of ``ShardWriter`` writing shards to moto's
S3 server on 127.0.0.1, directly and behind the fault proxy with a first
byte latency on every upload (tests/python/fault_proxy.py).

    python benches/write_s3_bench.py [--mb 200] [--shard-mb 50] [--write-delay-ms 20] [--repeats 3]

Samples are 1 MiB of random bytes each (made before the clock starts); each
run writes them under a fresh prefix; the median of the runs is reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "python"))

from fault_proxy import Faults, running_fault_proxy  # noqa: E402
from s3_server import TEST_KEY_ID, TEST_SECRET, running_s3_server  # noqa: E402

from shardstream import S3Config, ShardWriter  # noqa: E402

BUCKET = "bench-write"
SAMPLE_BYTES = 1 << 20


def write_once(endpoint: str, prefix: str, blobs: list[bytes], shard_mb: int) -> float:
    """Seconds to write `blobs` as shards of at most `shard_mb` MB."""
    s3 = S3Config(endpoint_url=endpoint, region="us-east-1", path_style=True)
    start = time.perf_counter()
    with ShardWriter(
        f"s3://{BUCKET}/{prefix}/shard-%04d.tar", max_count=None, max_bytes=shard_mb << 20, s3=s3
    ) as w:
        for i, blob in enumerate(blobs):
            w.write({"__key__": f"{i:06d}", "bin": blob})
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--shard-mb", type=int, default=50)
    parser.add_argument("--write-delay-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.update(AWS_ACCESS_KEY_ID=TEST_KEY_ID, AWS_SECRET_ACCESS_KEY=TEST_SECRET)
    blobs = [os.urandom(SAMPLE_BYTES) for _ in range((args.mb << 20) // SAMPLE_BYTES)]
    total_mb = len(blobs) * SAMPLE_BYTES / 1e6
    with ExitStack() as stack:
        server = stack.enter_context(running_s3_server())
        server.client().create_bucket(Bucket=BUCKET)
        proxy = stack.enter_context(
            running_fault_proxy(server.endpoint_url, Faults(write_delay=args.write_delay_ms / 1000))
        )
        profiles = {
            "direct": server.endpoint_url,
            f"{args.write_delay_ms:.0f} ms before each upload is answered": proxy.endpoint_url,
        }
        print("| network | MB/s (median) | runs (s) |")
        print("|---|---|---|")
        for n, (profile, endpoint) in enumerate(profiles.items()):
            runs = [
                write_once(endpoint, f"p{n}-r{r}", blobs, args.shard_mb)
                for r in range(args.repeats)
            ]
            seconds = statistics.median(runs)
            listed = ", ".join(f"{r:.2f}" for r in runs)
            print(f"| {profile} | {total_mb / seconds:.0f} | {listed} |")


if __name__ == "__main__":
    main()

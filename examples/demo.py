"""The demo behind `make demo`: makes a small audio dataset (if missing),
streams one epoch through a torch DataLoader with 2 workers, and prints the
throughput and one decoded sample; then streams it again with the fields
decoded and batched in Rust (``decode=True, batch_size=32``).

    python examples/demo.py data/demo
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
import wave
from pathlib import Path

from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))

from make_dataset import make_dataset

from shardstream import StreamingDataset


def keep_lists(batch: list[dict]) -> list[dict]:
    """Collate that keeps raw samples as they are."""
    return batch


def as_is(item: dict) -> dict:
    """Keeps a batch from Rust as it is (numpy arrays, tuples)."""
    return item


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--num-workers", type=int, default=2)
    args = parser.parse_args()

    shards = sorted(args.out_dir.glob("shard-*.tar"))
    if len(shards) != 8:
        print(f"making the example dataset in {args.out_dir} ...")
        shards = make_dataset(args.out_dir, shards=8, samples_per_shard=64)
    spec = str(args.out_dir / "shard-{000000..000007}.tar")
    dataset = StreamingDataset(spec, seed=0, shuffle_buffer=256)
    print(f"dataset: {dataset}")

    loader = DataLoader(dataset, batch_size=32, num_workers=args.num_workers, collate_fn=keep_lists)
    start = time.perf_counter()
    samples, first = 0, None
    for batch in loader:
        samples += len(batch)
        first = first or batch[0]
    elapsed = time.perf_counter() - start
    stats = dataset.stats()
    megabytes = stats["bytes_read"] / 1e6
    print(
        f"streamed {samples} samples ({megabytes:.1f} MB) from {len(shards)} shards "
        f"with {args.num_workers} workers in {elapsed:.2f} s: "
        f"{samples / elapsed:,.0f} samples/s, {megabytes / elapsed:,.0f} MB/s"
    )
    print(f"stats: {stats}")

    assert first is not None, "the dataset produced no samples"
    with wave.open(io.BytesIO(first["wav"])) as w:
        rate, frames = w.getframerate(), w.getnframes()
    meta = json.loads(first["json"])
    print("one sample:")
    print(f"  __key__ = {first['__key__']}")
    print(f"  __url__ = {first['__url__']}")
    print(f"  wav     = {len(first['wav'])} bytes: {frames} frames at {rate} Hz")
    print(f"  json    = {meta}")

    decoded = StreamingDataset(spec, seed=0, shuffle_buffer=256, decode=True, batch_size=32)
    loader = DataLoader(decoded, batch_size=None, num_workers=args.num_workers, collate_fn=as_is)
    start = time.perf_counter()
    batches = list(loader)
    elapsed = time.perf_counter() - start
    count = sum(len(b["__key__"]) for b in batches)
    print(
        f"decoded in Rust (decode=True, batch_size=32): {count} samples in {len(batches)} "
        f"batches in {elapsed:.2f} s: {count / elapsed:,.0f} samples/s"
    )
    audio, rate = batches[0]["wav"][0]
    print(f"  wav  = float32 array {tuple(audio.shape)} at {rate} Hz (a list: clips differ)")
    print(f"  json = {batches[0]['json'][0]}")


if __name__ == "__main__":
    main()

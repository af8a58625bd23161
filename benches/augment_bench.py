"""Augmentation benchmark behind `make bench`: CPU time per image of JPEG
decode + RandomResizedCrop(224) + horizontal flip, by shardstream's
``Image`` transform (Rust, on the decode threads, batches collated in Rust)
and by PIL + torchvision transforms in the DataLoader workers, over the same
undecoded samples read by shardstream, at the same worker count.

    python benches/augment_bench.py --out bench-results [--repeats 3]

The images are ~45 KB JPEGs of 500x375 (a photo-like pattern at quality
85), the size of ImageNet's. The consumer sums every batch, so every pixel
is touched. Each run is a fresh subprocess; CPU time is user + system time
of the run and its worker processes from the first batch requested to the
last (interpreter and torch start-up excluded). A "read only" row (the
samples as bytes, no decode) shows what reading and hand-off cost. Runs
are interleaved (A B C A B C ...) and the median is reported.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from decode_bench import cpu_seconds, measure, write_shards  # noqa: E402
from loader_bench import warm  # noqa: E402

BATCH = 64
SIZE = 224
READERS = ("shardstream Image", "PIL + torchvision in workers", "read only (bytes)")


def pil_pipeline():
    """The usual torchvision recipe on PIL images, ending in uint8 CHW
    tensors (the same output as ``Image(224, flip=0.5)``)."""
    from torchvision import transforms

    transform = transforms.Compose(
        [
            transforms.RandomResizedCrop(SIZE),
            transforms.RandomHorizontalFlip(),
            transforms.PILToTensor(),
        ]
    )

    def decode(sample: dict) -> dict:
        from PIL import Image

        image = Image.open(io.BytesIO(sample["jpg"])).convert("RGB")
        return {"jpg": transform(image), "cls": int(sample["cls"])}

    return decode


def run_epoch(spec: str, reader: str, num_workers: int) -> dict[str, float]:
    """One epoch in this process; returns the measurements."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    from shardstream import Image, StreamingDataset

    if reader == "shardstream Image":
        transform = Image(SIZE, crop="random_resized", flip=0.5)
        dataset = StreamingDataset(
            spec, seed=0, decode={"jpg": transform, "cls": "int"}, batch_size=BATCH
        )
        loader = DataLoader(dataset, batch_size=None, num_workers=num_workers)
    elif reader == "PIL + torchvision in workers":
        raw = StreamingDataset(spec, seed=0)
        decode = pil_pipeline()

        class Decoded(IterableDataset):
            def __iter__(self):
                return map(decode, raw)

        loader = DataLoader(Decoded(), batch_size=BATCH, num_workers=num_workers)
    else:
        dataset = StreamingDataset(spec, seed=0, batch_size=BATCH)
        loader = DataLoader(dataset, batch_size=None, num_workers=num_workers)

    # One intra-op thread: OpenMP threads spin while they wait, which would
    # be counted as CPU time of whichever pipeline runs torch ops here.
    torch.set_num_threads(1)

    def touch(batch: dict) -> tuple[int, int]:
        """Reads every byte of the batch's images (a wrapping sum of 8-byte words)."""
        images = batch["jpg"]
        if isinstance(images, list):  # bytes
            words = [np.frombuffer(b[: len(b) // 8 * 8], np.uint64) for b in images]
            return len(images), int(sum(int(w.sum()) for w in words))
        if isinstance(images, torch.Tensor):
            images = images.numpy()
        assert images.shape[1:] == (3, SIZE, SIZE) and images.dtype == np.uint8
        return len(images), int(images.reshape(-1).view(np.uint64).sum())

    start_cpu, start = cpu_seconds(), time.perf_counter()
    images = 0
    for batch in loader:
        n, _ = touch(batch)
        images += n
    del loader
    elapsed = time.perf_counter() - start
    return {"images": images, "seconds": elapsed, "cpu_seconds": cpu_seconds() - start_cpu}


def make_dataset(root: Path, shards: int, per_shard: int, jobs: int = 1) -> list[Path]:
    """Shards of 500x375 JPEGs of about 45 KB (smooth waves plus noise, at
    quality 85) and labels, made by `jobs` processes; each sample is seeded
    by its shard and index."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:375, 0:500]

    def sample(shard: int, i: int) -> tuple[tuple[str, bytes], ...]:
        rng = np.random.default_rng((0, shard, i))
        phase = rng.uniform(0, 6.28, 3)
        scale = rng.uniform(5, 40, 3)
        channels = [
            128 + 90 * np.sin(x / s + y / (s * 1.7) + p) for s, p in zip(scale, phase, strict=True)
        ]
        image = np.stack(channels, -1) + rng.normal(0, 7, (375, 500, 3))
        buf = io.BytesIO()
        Image.fromarray(image.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=85)
        key = f"photo{shard:03d}-{i:05d}"
        return ((f"{key}.jpg", buf.getvalue()), (f"{key}.cls", b"%d" % i))

    return write_shards(root, "photos", shards, per_shard, sample, jobs)


def mean_jpeg_kb(paths: list[Path]) -> float:
    sizes = []
    for path in paths:
        with tarfile.open(path) as tar:
            sizes += [m.size for m in tar.getmembers() if m.name.endswith(".jpg")]
    return statistics.mean(sizes) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--per-shard", type=int, default=128)
    parser.add_argument("--child", nargs=3, metavar=("SPEC", "READER", "WORKERS"))
    args = parser.parse_args()
    if args.child:
        spec, reader, workers = args.child
        print(json.dumps(run_epoch(spec, reader, int(workers))))
        return

    paths = make_dataset(args.out / "augment-data", args.shards, args.per_shard)
    warm(paths)
    spec = str(paths[0].parent)
    kb = mean_jpeg_kb(paths)
    rows = []
    for workers in args.workers:
        runs: dict[str, list[dict[str, float]]] = {r: [] for r in READERS}
        for _ in range(args.repeats):
            for reader in READERS:
                runs[reader].append(measure(spec, reader, workers, __file__))
        for reader in READERS:
            result = runs[reader]
            images = result[0]["images"]
            rows.append(
                {
                    "num_workers": workers,
                    "reader": reader,
                    "images": images,
                    "images_per_s": statistics.median(images / r["seconds"] for r in result),
                    "cpu_ms_per_image": statistics.median(
                        1000 * r["cpu_seconds"] / images for r in result
                    ),
                }
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "augment_bench.json").write_text(json.dumps(rows, indent=2))
    print(f"{len(paths)} shards, 500x375 JPEGs of {kb:.1f} KB on average, RRC({SIZE}) + flip")
    print("| num_workers | pipeline | images/s | CPU ms per image | vs PIL |")
    print("|---|---|---|---|---|")
    for row in rows:
        pil = next(
            r["cpu_ms_per_image"]
            for r in rows
            if r["num_workers"] == row["num_workers"] and r["reader"] == READERS[1]
        )
        print(
            f"| {row['num_workers']} | {row['reader']} | {row['images_per_s']:,.0f} | "
            f"{row['cpu_ms_per_image']:.2f} | {row['cpu_ms_per_image'] / pil:.2f}x |"
        )
    print(f"({os.cpu_count()} cores, {args.repeats} runs each, medians)")


if __name__ == "__main__":
    main()

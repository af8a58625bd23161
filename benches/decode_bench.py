"""Decode benchmark behind `make bench`: samples/s and CPU seconds of one
epoch with the fields decoded, by shardstream's Rust decoders
(``decode=True``, batches collated in Rust) and by Python decoders in the
DataLoader workers (json, wave + numpy, PIL) over the same undecoded
samples, at the same worker count.

    python benches/decode_bench.py --out bench-results [--repeats 3]

Two datasets: audio (``examples/make_dataset.py``: 16 kHz WAV plus JSON)
and JPEG (256x256 RGB images plus a class label). Each run is a fresh
subprocess; CPU seconds are user + system time of the run and its worker
processes. Runs are interleaved (A B A B ...) and the median is reported.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import statistics
import sys
import tarfile
import time
import wave
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

from child_run import run_child  # noqa: E402
from loader_bench import warm  # noqa: E402
from make_dataset import make_dataset  # noqa: E402

BATCH = 32
READERS = ("shardstream-rust-decode", "python-decode-in-workers")


def cpu_seconds() -> float:
    """User and system CPU seconds of this process and its waited-for
    children (DataLoader workers) so far."""
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def add_members(tar: tarfile.TarFile, members: Iterable[tuple[str, bytes]]) -> None:
    """Appends regular-file members `(name, data)` to `tar`."""
    for name, data in members:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def python_decode(sample: dict) -> dict:
    """Decodes a raw sample the way a Python pipeline would."""
    import numpy as np
    from PIL import Image

    out = {"__key__": sample["__key__"]}
    for field, data in sample.items():
        if field.startswith("__"):
            continue
        if field == "json":
            out[field] = json.loads(data)
        elif field == "wav":
            with wave.open(io.BytesIO(data)) as w:
                raw = w.readframes(w.getnframes())
                channels, rate = w.getnchannels(), w.getframerate()
            pcm = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
            out[field] = (pcm.reshape(-1, channels), rate)
        elif field in ("jpg", "png"):
            out[field] = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        elif field == "cls":
            out[field] = int(data)
        else:
            out[field] = data
    return out


def run_epoch(spec: str, reader: str, num_workers: int) -> dict[str, float]:
    """One epoch in this process; returns the measurements."""
    from torch.utils.data import DataLoader, IterableDataset

    from shardstream import StreamingDataset

    if reader == "shardstream-rust-decode":
        dataset = StreamingDataset(spec, seed=0, decode=True, batch_size=BATCH)
        loader = DataLoader(dataset, batch_size=None, num_workers=num_workers)
        count = lambda batch: len(batch["__key__"])  # noqa: E731
    else:
        raw = StreamingDataset(spec, seed=0)

        class Decoded(IterableDataset):
            def __iter__(self):
                return map(python_decode, raw)

        loader = DataLoader(Decoded(), batch_size=BATCH, num_workers=num_workers, collate_fn=list)
        count = len
    start = time.perf_counter()
    samples = sum(count(batch) for batch in loader)
    elapsed = time.perf_counter() - start
    return {"samples": samples, "seconds": elapsed, "cpu_seconds": cpu_seconds()}


def measure(spec: str, reader: str, num_workers: int, script: str = __file__) -> dict[str, float]:
    """Runs `run_epoch` of `script` (this benchmark or another with the same
    `--child SPEC READER WORKERS` mode) in a fresh subprocess."""
    return run_child(script, [spec, reader, str(num_workers)])


def write_shards(
    root: Path,
    prefix: str,
    shards: int,
    per_shard: int,
    sample: Callable[[int, int], Iterable[tuple[str, bytes]]],
    jobs: int = 1,
) -> list[Path]:
    """Tar shards `root/{prefix}-{shard:06d}.tar` of `per_shard` samples
    each, sample `i` of shard `shard` being the members `sample(shard, i)`,
    written by `jobs` forked processes. A shard already there is kept (and
    its samples are not made, so `sample` must not carry state from one
    shard to the next)."""
    root.mkdir(parents=True, exist_ok=True)
    paths = [root / f"{prefix}-{shard:06d}.tar" for shard in range(shards)]
    missing = [(path, shard) for shard, path in enumerate(paths) if not path.exists()]
    global _SHARD_SAMPLES
    _SHARD_SAMPLES = (sample, per_shard)
    if jobs > 1 and len(missing) > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(min(jobs, len(missing))) as pool:
            pool.starmap(write_shard, missing)
    else:
        for path, shard in missing:
            write_shard(path, shard)
    return paths


_SHARD_SAMPLES: Any = None


def write_shard(path: Path, shard: int) -> None:
    """Shard `shard` of the `write_shards` in progress, written to a
    temporary name and renamed into place (an interrupted run leaves no
    short shard behind)."""
    sample, per_shard = _SHARD_SAMPLES
    partial = path.with_suffix(".partial")
    with tarfile.open(partial, "w") as tar:
        for i in range(per_shard):
            add_members(tar, sample(shard, i))
    partial.rename(path)


def make_jpeg_dataset(root: Path, shards: int, per_shard: int) -> list[Path]:
    """Shards of 256x256 JPEG images (smooth gradients plus noise) and labels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:256, 0:256]

    def sample(shard: int, i: int) -> tuple[tuple[str, bytes], ...]:
        phase = rng.uniform(0, 6.28, 3)
        channels = [128 + 100 * np.sin(x / 23 + y / 31 + p) for p in phase]
        image = np.stack(channels, -1) + rng.normal(0, 12, (256, 256, 3))
        buf = io.BytesIO()
        Image.fromarray(image.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
        key = f"img{shard:03d}-{i:05d}"
        return ((f"{key}.jpg", buf.getvalue()), (f"{key}.cls", b"%d" % (i % 10)))

    return write_shards(root, "images", shards, per_shard, sample)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=3, metavar=("SPEC", "READER", "WORKERS"))
    args = parser.parse_args()
    if args.child:
        spec, reader, workers = args.child
        print(json.dumps(run_epoch(spec, reader, int(workers))))
        return

    data = args.out / "decode-data"
    audio = make_dataset(data / "audio", shards=8, samples_per_shard=64, seed=0)
    images = make_jpeg_dataset(data / "images", shards=8, per_shard=64)
    datasets = {"audio (wav + json)": audio, "jpeg 256x256 + cls": images}
    rows = []
    for name, paths in datasets.items():
        warm(paths)
        spec = str(paths[0].parent)
        for workers in (0, 2):
            runs: dict[str, list[dict[str, float]]] = {r: [] for r in READERS}
            for _ in range(args.repeats):
                for reader in READERS:
                    runs[reader].append(measure(spec, reader, workers))
            for reader in READERS:
                result = runs[reader]
                samples = result[0]["samples"]
                rows.append(
                    {
                        "dataset": name,
                        "num_workers": workers,
                        "reader": reader,
                        "samples": samples,
                        "samples_per_s": statistics.median(samples / r["seconds"] for r in result),
                        "cpu_seconds": statistics.median(r["cpu_seconds"] for r in result),
                    }
                )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_bench.json").write_text(json.dumps(rows, indent=2))
    print("| dataset | num_workers | reader | samples/s | CPU seconds per epoch |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['dataset']} | {row['num_workers']} | {row['reader']} | "
            f"{row['samples_per_s']:,.0f} | {row['cpu_seconds']:.2f} |"
        )
    print(f"({os.cpu_count()} cores, {args.repeats} runs each, medians)")


if __name__ == "__main__":
    main()

"""Audio clip benchmark behind `make bench`: CPU time per clip for decode +
mix to mono + resample 44.1 kHz -> 16 kHz + crop to 4 s, by shardstream's
``AudioClip`` (Rust, on the decode threads, batches collated in Rust) and by
soundfile + scipy in the DataLoader workers, over the same WAV shards, at
the same worker count.

    python benches/audio_bench.py --out bench-results [--repeats 3] [--workers 2]

The clips are 10 s of 16-bit stereo at 44.1 kHz (two tones and noise).
Both readers give a float32 (32, 64000) batch and the (32,) real frame
counts. The Python recipe: ``soundfile.read(dtype="float32")``, the mean of
the channels, ``scipy.signal.resample_poly(x, 160, 441)`` (its default
Kaiser-windowed FIR), a random 4 s window. Each run is a fresh subprocess;
CPU seconds are user + system time of the epoch in the main process and
its worker processes (the imports before it are left out). Runs are
interleaved (A B A B ...) and medians reported.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
import wave
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from decode_bench import cpu_seconds, measure, write_shards  # noqa: E402
from loader_bench import warm  # noqa: E402

BATCH = 32
RATE_IN, RATE_OUT, SECONDS, CLIP_SECONDS = 44100, 16000, 10, 4
READERS = ("shardstream-AudioClip", "soundfile+scipy-in-workers")


def make_wav_dataset(root: Path, shards: int, per_shard: int) -> list[Path]:
    """Shards of 10 s stereo 16-bit 44.1 kHz WAV clips."""
    import numpy as np

    rng = np.random.default_rng(0)
    t = np.arange(RATE_IN * SECONDS) / RATE_IN

    def sample(shard: int, i: int) -> tuple[tuple[str, bytes], ...]:
        f1, f2 = rng.uniform(100, 4000, 2)
        left = 0.3 * np.sin(2 * np.pi * f1 * t) + rng.normal(0, 0.05, t.size)
        right = 0.3 * np.sin(2 * np.pi * f2 * t) + rng.normal(0, 0.05, t.size)
        pcm = (np.stack([left, right], 1) * 32767).astype("<i2")
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(2)
            w.setsampwidth(2)
            w.setframerate(RATE_IN)
            w.writeframes(pcm.tobytes())
        key = f"clip{shard:03d}-{i:05d}"
        return ((f"{key}.wav", buf.getvalue()), (f"{key}.cls", b"%d" % (i % 10)))

    return write_shards(root, "clips", shards, per_shard, sample)


def python_clip(sample: dict, rng) -> dict:
    """A raw sample's clip, the way a Python pipeline would make it."""
    import numpy as np
    import soundfile
    from scipy.signal import resample_poly

    audio, rate = soundfile.read(io.BytesIO(sample["wav"]), dtype="float32")
    mono = audio.mean(axis=1) if audio.ndim == 2 else audio
    resampled = resample_poly(mono, RATE_OUT, rate).astype(np.float32)
    frames = RATE_OUT * CLIP_SECONDS
    start = int(rng.integers(0, max(resampled.size - frames, 0) + 1))
    clip = np.zeros(frames, np.float32)
    real = resampled[start : start + frames]
    clip[: real.size] = real
    return {"wav": clip, "wav_frames": real.size, "cls": int(sample["cls"])}


def run_epoch(spec: str, reader: str, num_workers: int) -> dict[str, float]:
    """One epoch in this process; returns the measurements."""
    import numpy as np
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info

    import shardstream
    from shardstream import StreamingDataset

    if reader == "shardstream-AudioClip":
        clip = shardstream.AudioClip(sample_rate=RATE_OUT, seconds=CLIP_SECONDS)
        dataset = StreamingDataset(
            spec, seed=0, decode={"wav": clip, "cls": "int"}, batch_size=BATCH
        )
        loader = DataLoader(dataset, batch_size=None, num_workers=num_workers)
    else:
        import scipy.signal  # noqa: F401  (imported before the workers fork)
        import soundfile  # noqa: F401

        raw = StreamingDataset(spec, seed=0)

        class Clips(IterableDataset):
            def __iter__(self):
                info = get_worker_info()
                rng = np.random.default_rng(info.id if info else 0)
                return (python_clip(sample, rng) for sample in raw)

        loader = DataLoader(Clips(), batch_size=BATCH, num_workers=num_workers)
    start_cpu, start = cpu_seconds(), time.perf_counter()
    samples = 0
    for batch in loader:
        assert tuple(batch["wav"].shape) == (len(batch["wav_frames"]), RATE_OUT * CLIP_SECONDS)
        samples += len(batch["wav_frames"])
    elapsed = time.perf_counter() - start
    return {"samples": samples, "seconds": elapsed, "cpu_seconds": cpu_seconds() - start_cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--per-shard", type=int, default=32)
    parser.add_argument("--child", nargs=3, metavar=("SPEC", "READER", "WORKERS"))
    args = parser.parse_args()
    if args.child:
        spec, reader, workers = args.child
        print(json.dumps(run_epoch(spec, reader, int(workers))))
        return

    paths = make_wav_dataset(args.out / "audio-clip-data", args.shards, args.per_shard)
    warm(paths)
    spec = str(paths[0].parent)
    runs: dict[str, list[dict[str, float]]] = {r: [] for r in READERS}
    for _ in range(args.repeats):
        for reader in READERS:
            runs[reader].append(measure(spec, reader, args.workers, __file__))
    rows = []
    for reader in READERS:
        result = runs[reader]
        samples = result[0]["samples"]
        rows.append(
            {
                "reader": reader,
                "num_workers": args.workers,
                "clips": samples,
                "cpu_ms_per_clip": statistics.median(
                    1000 * r["cpu_seconds"] / samples for r in result
                ),
                "clips_per_s": statistics.median(samples / r["seconds"] for r in result),
            }
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "audio_bench.json").write_text(json.dumps(rows, indent=2))
    base = rows[1]["cpu_ms_per_clip"]
    print("| reader | num_workers | CPU ms per clip | vs soundfile+scipy | clips/s |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['reader']} | {row['num_workers']} | {row['cpu_ms_per_clip']:.2f} | "
            f"{row['cpu_ms_per_clip'] / base:.2f}x | {row['clips_per_s']:,.0f} |"
        )
    print(f"({os.cpu_count()} cores, {rows[0]['clips']} clips, {args.repeats} runs each, medians)")


if __name__ == "__main__":
    main()

"""Make a small, deterministic WebDataset-style audio dataset for shardstream.

The output is a directory of plain tar shards, ``{prefix}-{i:06d}.tar``. Each
shard holds ``samples_per_shard`` samples, and every sample is two consecutive
tar members that share a key::

    sample-{shard:06d}-{index:06d}.wav   16 kHz mono 16-bit PCM WAV
    sample-{shard:06d}-{index:06d}.json  UTF-8 JSON metadata

The WAV is a sine tone (with short fades and a little noise) whose frequency
depends on the sample's label. The JSON holds ``key``, ``shard``, ``index``,
``label`` (0..9), ``seconds``, ``frequency_hz`` and a short ``text``
transcript.

The output is byte-for-byte reproducible: every random choice comes from a
seeded ``random.Random``, and tar members get fixed metadata (mtime 0,
uid/gid 0, empty owner names, mode 0o644). Shard ``i`` depends only on the
seed, ``i`` and the per-shard/duration arguments, so ``--shards`` only
decides how many shards are written.

Only the standard library is used. Example::

    python examples/make_dataset.py /tmp/shards --shards 8 --samples-per-shard 64
"""

from __future__ import annotations

import argparse
import io
import json
import math
import operator
import os
import random
import sys
import tarfile
import wave
from array import array
from pathlib import Path

SAMPLE_RATE = 16_000
"""Frames per second of every WAV file."""

NUM_LABELS = 10
AMPLITUDE = 12_000
"""Peak of the sine tone, in 16-bit PCM units."""

NOISE_LEVEL = 200
"""Noise is uniform in [-NOISE_LEVEL, NOISE_LEVEL]; with AMPLITUDE it cannot clip."""

NOISE_SPAN = SAMPLE_RATE
"""Range of random start offsets into the shared noise bed."""

FADE_SECONDS = 0.01
FREQUENCY_STEP_HZ = 10
"""Frequencies are multiples of this, so the tone repeats every 1/10 s."""

LABEL_WORDS = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
)
VOCABULARY = (
    "bright",
    "calm",
    "distant",
    "gentle",
    "hollow",
    "low",
    "quiet",
    "rising",
    "steady",
    "warm",
    "bell",
    "chime",
    "hum",
    "note",
    "pulse",
    "signal",
    "tone",
    "whistle",
)


def _tone_period(frequency_hz: int) -> array:
    """Return one exact period of the tone as int16 samples.

    ``frequency_hz`` is an integer, so after ``SAMPLE_RATE // gcd`` frames the
    phase returns to zero and the tone can be built by repeating this block.
    """
    length = SAMPLE_RATE // math.gcd(frequency_hz, SAMPLE_RATE)
    step = 2.0 * math.pi * frequency_hz / SAMPLE_RATE
    return array("h", [round(AMPLITUDE * math.sin(step * n)) for n in range(length)])


def _noise_bed(seed: int, max_frames: int) -> array:
    """Return shared noise, long enough for any clip at any start offset."""
    rng = random.Random(f"{seed}-noise")
    size = max_frames + NOISE_SPAN
    return array("h", [rng.randint(-NOISE_LEVEL, NOISE_LEVEL) for _ in range(size)])


def _render(frequency_hz: int, frames: int, noise: array, offset: int) -> bytes:
    """Return little-endian 16-bit PCM for a faded sine tone plus noise."""
    period = _tone_period(frequency_hz)
    tone = (period * (frames // len(period) + 1))[:frames]
    pcm = array("h", map(operator.add, tone, noise[offset : offset + frames]))
    fade = min(int(FADE_SECONDS * SAMPLE_RATE), frames // 2)
    for n in range(fade):
        pcm[n] = pcm[n] * n // fade
        pcm[frames - 1 - n] = pcm[frames - 1 - n] * n // fade
    if sys.byteorder == "big":
        pcm.byteswap()
    return pcm.tobytes()


def _wav_bytes(pcm: bytes) -> bytes:
    """Wrap raw mono 16-bit PCM in a WAV container."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(SAMPLE_RATE)
        wav.writeframes(pcm)
    return buffer.getvalue()


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """Add ``data`` as a regular file with fixed, reproducible metadata."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def _write_shard(
    path: Path,
    shard: int,
    *,
    samples_per_shard: int,
    seed: int,
    min_seconds: float,
    max_seconds: float,
    noise: array,
) -> None:
    """Write one shard to ``path`` (via a temporary file and rename)."""
    rng = random.Random(f"{seed}-{shard}")
    tmp = path.with_name(path.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for index in range(samples_per_shard):
            key = f"sample-{shard:06d}-{index:06d}"
            label = rng.randrange(NUM_LABELS)
            frequency_hz = 200 + 100 * label + FREQUENCY_STEP_HZ * rng.randrange(10)
            frames = max(1, round(rng.uniform(min_seconds, max_seconds) * SAMPLE_RATE))
            seconds = frames / SAMPLE_RATE
            offset = rng.randrange(NOISE_SPAN)
            words = rng.choices(VOCABULARY, k=rng.randint(3, 7))
            text = " ".join([LABEL_WORDS[label], *words])

            pcm = _render(frequency_hz, frames, noise, offset)
            meta = {
                "key": key,
                "shard": shard,
                "index": index,
                "label": label,
                "seconds": seconds,
                "frequency_hz": float(frequency_hz),
                "text": text,
            }
            _add_member(tar, f"{key}.wav", _wav_bytes(pcm))
            _add_member(tar, f"{key}.json", json.dumps(meta, ensure_ascii=False).encode())
    os.replace(tmp, path)


def make_dataset(
    out_dir: str | os.PathLike[str],
    *,
    shards: int = 8,
    samples_per_shard: int = 64,
    seed: int = 0,
    prefix: str = "shard",
    min_seconds: float = 1.0,
    max_seconds: float = 4.0,
) -> list[Path]:
    """Write ``shards`` tar shards into ``out_dir`` and return their paths.

    Output is byte-identical for the same arguments. Existing shards with the
    same names are overwritten; other files in ``out_dir`` are left alone.
    """
    if shards < 0:
        raise ValueError(f"shards must be >= 0, got {shards}")
    if samples_per_shard < 0:
        raise ValueError(f"samples_per_shard must be >= 0, got {samples_per_shard}")
    if not 0 < min_seconds <= max_seconds:
        raise ValueError(
            "need 0 < min_seconds <= max_seconds, "
            f"got min_seconds={min_seconds}, max_seconds={max_seconds}"
        )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    noise = _noise_bed(seed, math.ceil(max_seconds * SAMPLE_RATE) + 1)
    paths = []
    for shard in range(shards):
        path = out / f"{prefix}-{shard:06d}.tar"
        _write_shard(
            path,
            shard,
            samples_per_shard=samples_per_shard,
            seed=seed,
            min_seconds=min_seconds,
            max_seconds=max_seconds,
            noise=noise,
        )
        paths.append(path)
    return paths


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Make a small, deterministic WebDataset-style audio dataset."
    )
    parser.add_argument("out_dir", type=Path, help="directory to write shards into")
    parser.add_argument("--shards", type=int, default=8, help="number of shards (default: 8)")
    parser.add_argument(
        "--samples-per-shard",
        type=int,
        default=64,
        help="samples in each shard (default: 64)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--prefix", default="shard", help="shard file name prefix (default: shard)")
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=1.0,
        help="shortest clip in seconds (default: 1.0)",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=4.0,
        help="longest clip in seconds (default: 4.0)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    try:
        paths = make_dataset(
            args.out_dir,
            shards=args.shards,
            samples_per_shard=args.samples_per_shard,
            seed=args.seed,
            prefix=args.prefix,
            min_seconds=args.min_seconds,
            max_seconds=args.max_seconds,
        )
    except ValueError as error:
        sys.exit(f"error: {error}")
    total_bytes = sum(path.stat().st_size for path in paths)
    print(
        f"wrote {len(paths)} shards, {len(paths) * args.samples_per_shard} samples, "
        f"{total_bytes} bytes to {args.out_dir}"
    )


if __name__ == "__main__":
    main()

"""Mutation fuzzing of the shard parsers (tar, tar.gz, tar.zst, Parquet) and
of the JPEG decoder of ``shardstream.Image`` (libjpeg-turbo).

Small valid shards are damaged at random (bit flips, byte overwrites,
truncations, inserted and deleted ranges, one to three at a time) and
streamed with ``StreamingDataset`` (shards in order, no shuffle buffer),
under ``on_error="raise"`` and ``"warn"`` in turn. Every case must end, within
a time bound, with samples and at most a ``shardstream.ShardStreamError``:
no other exception (a pyo3 ``PanicException`` included), no death of the
process, no hang. The cases run in a child process, so that an abort or a
crash fails this test with the case that caused it instead of ending the
test run; each case has its own timer there.

What is delivered must be right as far as the format can tell:

- **gzip** (any level) and **zstd with a content checksum**: the CRC-32 and
  length of each gzip member, the checksum of each zstd frame, cover every
  decoded byte, and no sample is handed out before the bytes it came from
  passed them (the shards are far smaller than the verify budget). So the
  samples delivered are exactly the original ones, in order, a prefix of
  them: a sample whose key was damaged into a new key is never delivered.
  One hole: a zstd frame header is covered by nothing, and damage there can
  clear its checksum flag; cases that change the first bytes of a zstd
  stream only get the crash checks.
- **zstd without a checksum**: nothing checks the decoded bytes; crash
  checks only.
- **plain tar**: each header has a checksum (a sum of its bytes, which any
  one changed byte breaks, but two changes can cancel), the data has none,
  so changed data bytes ARE delivered changed. Only the samples that end,
  with the header of the next sample, before the first changed byte are
  known: they must all be delivered, equal to the originals. Samples past
  it may be changed, or have keys that were damaged into new ones.
- **Parquet with page CRC-32s**: the CRCs cover the pages' data, not the
  page headers nor the footer. When every change is a byte changed in
  place inside the values of a page, the rows delivered must be original
  rows, in order (a row group that fails is skipped under ``"warn"``).
  Other damage gets the crash checks only.
- **JPEG** (``Image`` on baseline, progressive, gray, 4:4:4 and CMYK JPEGs
  made by PIL): the damage goes into one JPEG of a tar shard, not into the
  tar. A JPEG has no checksum, so damaged pixels may be delivered: crash
  checks only.

``SHARDSTREAM_FUZZ_CASES`` (default 300) and ``SHARDSTREAM_FUZZ_SEED`` set
the number of cases and the seed; ``make fuzz`` runs many more.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import tempfile
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_CASES = 300
DEFAULT_SEED = 20_240_601
# Seconds one case may take in the child process (they take milliseconds).
CASE_SECONDS = 20


# --------------------------------------------------------------------------
# The pytest side: run the cases in a child process and read its report.
# --------------------------------------------------------------------------


def test_mutated_shards_never_crash_hang_or_deliver_wrong_samples():
    cases = int(os.environ.get("SHARDSTREAM_FUZZ_CASES", DEFAULT_CASES))
    seed = int(os.environ.get("SHARDSTREAM_FUZZ_SEED", DEFAULT_SEED))
    command = [sys.executable, __file__, "--cases", str(cases), "--seed", str(seed)]
    try:
        proc = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=120 + cases * 2,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the fuzz run (seed {seed}) did not end: {exc}") from None
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    started = [line for line in lines if line["event"] == "start"]
    problems = [line for line in lines if line["event"] == "problem"]
    last = started[-1] if started else None
    assert proc.returncode == 0, (
        f"the fuzz process died (exit {proc.returncode}, seed {seed}) during {last}\n"
        f"{proc.stderr[-4000:]}"
    )
    assert not problems, json.dumps(problems[:5], indent=1)
    done = [line for line in lines if line["event"] == "done"]
    assert done and done[0]["cases"] == cases, proc.stdout[-2000:] + proc.stderr[-2000:]
    # Damage was found (errors) and survived (samples) in every kind.
    for kind, counts in done[0]["by_kind"].items():
        assert counts["cases"] == 0 or counts["errors"] > 0, (kind, counts)


# --------------------------------------------------------------------------
# The child side.
# --------------------------------------------------------------------------


@dataclass
class Seed:
    """A valid shard, how it is named, and what shardstream reads from it."""

    kind: str
    suffix: str
    data: bytes
    samples: list[dict[str, Any]] = field(default_factory=list)
    # Plain tar: per sample, the offset where the header that ends it ends.
    settled_at: list[int] = field(default_factory=list)
    # Parquet: the byte ranges holding page values (covered by page CRCs).
    verified: list[tuple[int, int]] = field(default_factory=list)
    # JPEG: the tar's members, one of which each case damages.
    members: list[tuple[str, bytes]] = field(default_factory=list)


def fuzz_members(rng: random.Random, count: int) -> list[tuple[str, bytes]]:
    """``count`` samples of two or three members, some empty, some long."""
    members = []
    for i in range(count):
        key = f"k{i:02d}" if i % 3 else f"dir.v{i}/k{i:02d}"
        members.append((f"{key}.bin", rng.randbytes(rng.choice([0, 1, 200, 511, 512, 1300]))))
        members.append((f"{key}.json", json.dumps({"i": i}).encode()))
        if i % 2:
            members.append((f"{key}.txt", b"t" * rng.randrange(1, 700)))
    return members


def tar_of(members: list[tuple[str, bytes]], fmt: int) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def settled_offsets(data: bytes) -> list[int]:
    """Per sample of a plain tar, the offset before which every byte must be
    as it was for the sample to be known: where the header that ends it
    ends (the first data byte of the next sample's first member); for the
    last sample, past the end of the shard (what follows the end-of-archive
    marker is read and must be zeros before it is handed out)."""
    from _shardtest import split_member

    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        members = [m for m in tar if m.isreg() and split_member(m.name)]
    starts, last_key = [], None
    for member in members:
        key = split_member(member.name)[0]
        if key != last_key:
            starts.append(member.offset_data)
            last_key = key
    return [*starts[1:], len(data) + 1]


def parquet_seed(rng: random.Random) -> Seed:
    """A Parquet file of non-nullable plain values in uncompressed pages
    with CRC-32s, one page per column chunk: each chunk's page values are
    its last ``8 * rows`` bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 60
    table = pa.table(
        {
            "id": pa.array([rng.getrandbits(62) for _ in range(rows)], pa.int64()),
            "x": pa.array([rng.random() for _ in range(rows)], pa.float64()),
        },
        schema=pa.schema([pa.field("id", pa.int64(), False), pa.field("x", pa.float64(), False)]),
    )
    buffer = io.BytesIO()
    pq.write_table(
        table,
        buffer,
        row_group_size=20,
        compression="none",
        use_dictionary=False,
        write_statistics=False,
        write_page_checksum=True,
        data_page_size=1 << 20,
    )
    data = buffer.getvalue()
    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    verified = []
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            column = group.column(c)
            end = column.data_page_offset + column.total_compressed_size
            verified.append((end - 8 * group.num_rows, end))
    return Seed("parquet", ".parquet", data, verified=verified)


def jpeg_seed(rng: random.Random) -> Seed:
    """A tar of small JPEGs of each kind the decoder takes its own path for:
    baseline 4:2:0, progressive, gray, 4:4:4 (libjpeg-turbo's cropped and
    scaled decode) and CMYK (decoded whole)."""
    from PIL import Image as PILImage

    members = []
    kinds = [
        ("RGB", {}),
        ("RGB", {"progressive": True}),
        ("L", {}),
        ("RGB", {"subsampling": 0}),
        ("CMYK", {}),
    ]
    for i, (mode, options) in enumerate(kinds):
        width, height = rng.randrange(40, 90), rng.randrange(30, 70)
        pixels = bytes(
            (x * 5 + y * 3 + rng.randrange(16)) % 256
            for y in range(height)
            for x in range(width * 3)
        )
        image = PILImage.frombytes("RGB", (width, height), pixels).convert(mode)
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=90, **options)
        members.append((f"k{i}.jpg", buffer.getvalue()))
    return Seed("jpeg", ".tar", tar_of(members, tarfile.GNU_FORMAT), members=members)


def build_seeds(rng: random.Random) -> list[Seed]:
    import gzip

    import zstandard

    plain = tar_of(fuzz_members(rng, 6), tarfile.GNU_FORMAT)
    long_names = tar_of(
        [(f"{'d' * 120}/{name}", data) for name, data in fuzz_members(rng, 3)],
        tarfile.PAX_FORMAT,
    )
    inner = tar_of(fuzz_members(rng, 5), tarfile.GNU_FORMAT)
    return [
        Seed("tar", ".tar", plain, settled_at=settled_offsets(plain)),
        Seed("tar-pax", ".tar", long_names, settled_at=settled_offsets(long_names)),
        Seed("gz", ".tar.gz", gzip.compress(inner, mtime=0)),
        Seed("gz-stored", ".tar.gz", gzip.compress(inner, compresslevel=0, mtime=0)),
        Seed(
            "zst",
            ".tar.zst",
            zstandard.ZstdCompressor(level=3, write_checksum=True).compress(inner),
        ),
        Seed("zst-unchecked", ".tar.zst", zstandard.ZstdCompressor(level=3).compress(inner)),
        parquet_seed(rng),
        jpeg_seed(rng),
    ]


def mutate(data: bytes, rng: random.Random) -> tuple[bytes, list[str]]:
    """``data`` with one to three random changes, and their description."""
    out = bytearray(data)
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        what = rng.choice(
            ["flip", "flip", "flip", "byte", "truncate", "truncate", "insert", "delete"]
        )
        at = rng.randrange(len(out) + 1)
        if what == "truncate" and rng.random() < 0.5:
            # At a 512-byte block, where a tar's headers are: as a copy cut at
            # a block boundary leaves a shard.
            at = rng.randrange(len(out) // 512 + 1) * 512
        if what == "flip" and at < len(out):
            bit = rng.randrange(8)
            out[at] ^= 1 << bit
            done.append(f"flip bit {bit} at {at}")
        elif what == "byte" and at < len(out):
            value = rng.choice([0, 0xFF, rng.randrange(256)])
            out[at] = value
            done.append(f"byte {value} at {at}")
        elif what == "truncate":
            del out[at:]
            done.append(f"truncate at {at}")
        elif what == "insert":
            count = rng.choice([1, 7, 512, rng.randrange(1, 2000)])
            fill = rng.choice([bytes(count), rng.randbytes(count)])
            out[at:at] = fill
            done.append(f"insert {count} at {at}")
        elif what == "delete":
            count = rng.choice([1, 7, 512, rng.randrange(1, 2000)])
            del out[at : at + count]
            done.append(f"delete {count} at {at}")
    return bytes(out), done


def first_difference(a: bytes, b: bytes) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def only_verified_changes(seed: Seed, mutated: bytes) -> bool:
    """Whether every change is a byte changed in place inside page values."""
    if len(mutated) != len(seed.data):
        return False
    changed = [i for i, (x, y) in enumerate(zip(seed.data, mutated, strict=True)) if x != y]
    return all(any(lo <= i < hi for lo, hi in seed.verified) for i in changed)


def is_panic(error: BaseException) -> bool:
    """A Rust panic reported as an error (a bug), apart from those of the
    Parquet decoder on corrupt pages, which are caught where it runs and
    reported as the corrupt row group they are."""
    message = str(error).replace("decoder panicked", "")
    return "panic" in message.lower() or "internal error" in message.lower()


class CaseTimeout(Exception):
    """A case ran past its time bound."""


def stream(
    path: Path, on_error: str, images: bool
) -> tuple[list[dict], BaseException | None, bool]:
    """The samples of ``path`` (its JPEGs through ``Image`` when ``images``),
    what ended the stream, other than its end, and whether a bad shard was
    skipped (``on_error="warn"``)."""
    import shardstream

    got: list[dict] = []
    ds = None
    decode = {"jpg": shardstream.Image(24)} if images else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", shardstream.ShardSkippedWarning)
            ds = shardstream.StreamingDataset(
                path, shuffle_shards=False, shuffle_buffer=0, on_error=on_error, decode=decode
            )
            for sample in ds:
                got.append(sample)
    except BaseException as exc:  # a PanicException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, CaseTimeout)):
            raise
        return got, exc, False
    assert ds is not None
    return got, None, ds.stats()["errors_skipped"] > 0


def fields_of(sample: dict) -> dict:
    return {k: v for k, v in sample.items() if k != "__url__"}


def check(
    seed: Seed, mutated: bytes, got: list[dict], path: Path, on_error: str, complained: bool
) -> str | None:
    """What is wrong with ``got`` as read from ``mutated``, if anything;
    ``complained``: the read raised or skipped the shard."""
    if any(s.get("__url__") != str(path) for s in got):
        return "a sample of another URL"
    original = [fields_of(s) for s in seed.samples]
    delivered = [fields_of(s) for s in got]
    # A shard cut short is an error, or lost nothing (the cut was in the
    # zeros after its last member): never a shorter shard without a word.
    cut_short = seed.kind not in ("parquet", "jpeg") and seed.data.startswith(mutated)
    if cut_short and not complained and delivered != original:
        return f"a shard cut at {len(mutated)} of {len(seed.data)} bytes read as a shorter one"
    if seed.kind in ("gz", "gz-stored") or (
        seed.kind == "zst" and first_difference(seed.data, mutated) >= 18
    ):
        if delivered != original[: len(delivered)]:
            return "samples that are not the original ones, in order"
    elif seed.kind == "jpeg":
        return None
    elif seed.kind.startswith("tar"):
        first = first_difference(seed.data, mutated)
        known = [s for s, end in zip(original, seed.settled_at, strict=True) if end <= first]
        head = delivered[: len(known)]
        if head != known[: len(head)]:
            return f"the samples before the first change (at {first}) are not the originals"
        # Under "raise" the error may come before any sample (a local tar's
        # headers may be read when the dataset is made); under "warn" the
        # shard is read until the damage.
        if on_error == "warn" and len(head) < len(known):
            return f"samples before the first change (at {first}) are missing"
    elif seed.kind == "parquet" and only_verified_changes(seed, mutated):
        by_key = {s["__key__"]: s for s in original}
        keys = [s["__key__"] for s in delivered]
        if any(by_key.get(s["__key__"]) != s for s in delivered):
            return "rows that are not the original ones"
        if keys != sorted(set(keys), key=int):
            return "rows out of order or repeated"
    return None


def run_cases(cases: int, seed_value: int) -> None:
    import shardstream

    rng = random.Random(seed_value)
    seeds = build_seeds(rng)
    stats = {s.kind: {"cases": 0, "errors": 0, "samples": 0} for s in seeds}

    def emit(**fields: Any) -> None:
        print(json.dumps(fields), flush=True)

    def on_alarm(signum: int, frame: Any) -> None:
        raise CaseTimeout(f"a case ran past {CASE_SECONDS} s")

    signal.signal(signal.SIGALRM, on_alarm)
    with tempfile.TemporaryDirectory(prefix="shardstream-fuzz-") as tmp:
        root = Path(tmp)
        for seed in seeds:
            path = root / f"seed-{seed.kind}{seed.suffix}"
            path.write_bytes(seed.data)
            seed.samples, error, _ = stream(path, "raise", bool(seed.members))
            if error is not None or not seed.samples:
                emit(event="problem", case=-1, kind=seed.kind, problem=f"bad seed: {error!r}")
        for case in range(cases):
            seed = seeds[case % len(seeds)]
            if seed.members:
                damaged = rng.randrange(len(seed.members))
                name, data = seed.members[damaged]
                data, mutations = mutate(data, rng)
                mutations = [f"{name}: {m}" for m in mutations]
                members = [*seed.members[:damaged], (name, data), *seed.members[damaged + 1 :]]
                mutated = tar_of(members, tarfile.GNU_FORMAT)
            else:
                mutated, mutations = mutate(seed.data, rng)
            # Each kind in turn under "raise" and "warn".
            on_error = "warn" if (case // len(seeds)) % 2 else "raise"
            path = root / f"case-{case}{seed.suffix}"
            path.write_bytes(mutated)
            describe = {"case": case, "seed": seed_value, "kind": seed.kind}
            emit(event="start", mutations=mutations, on_error=on_error, **describe)
            signal.alarm(CASE_SECONDS)
            try:
                got, error, skipped = stream(path, on_error, bool(seed.members))
            except CaseTimeout as exc:
                emit(event="problem", problem=str(exc), mutations=mutations, **describe)
                continue
            finally:
                signal.alarm(0)
            stats[seed.kind]["cases"] += 1
            stats[seed.kind]["samples"] += len(got)
            problem = None
            if error is not None:
                stats[seed.kind]["errors"] += 1
                if not isinstance(error, shardstream.ShardStreamError) or is_panic(error):
                    trace = "".join(traceback.format_exception(error))[-1500:]
                    problem = f"raised {type(error).__name__}: {trace}"
                elif on_error == "warn" and error is not None and seed.kind != "parquet":
                    # Under "warn" a bad shard is skipped; a Parquet file's
                    # footer is read when the dataset is made, and a bad
                    # one raises there.
                    problem = f"raised under on_error='warn': {error}"
            complained = error is not None or skipped
            problem = problem or check(seed, mutated, got, path, on_error, complained)
            if problem:
                emit(event="problem", problem=problem, mutations=mutations, **describe)
            path.unlink()
    emit(event="done", cases=cases, by_kind=stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=DEFAULT_CASES)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args()
    run_cases(args.cases, args.seed)


if __name__ == "__main__":
    main()

"""Side-by-side benchmark behind `make bench-peers`: one epoch of the same data
through torch's DataLoader with shardstream, webdataset, LitData, MosaicML
Streaming and Hugging Face `datasets` streaming.

    python benches/peers/peers_bench.py --out bench-results [--quick]
        [--profiles audio small] [--repeats 3] [--mds-python .venv-peers-mds/bin/python]
        [--storage s3 [--first-byte-ms 20 --mbps 100]]

Three profiles, generated here deterministically: "audio" (16 kHz WAV of 1-4 s
plus JSON, ~80 KB per sample, 16 tar shards; `examples/make_dataset.py`),
"small" (200-byte `.txt` plus `.cls`, 200k samples, 8 tar shards) and "jpeg"
(real 320x240 JPEGs of ~45 KB made with PIL from gradients and seeded noise,
plus `.cls`, 4,096 samples, 16 tar shards). On the "jpeg" profile the consumer
touches every byte it is given (a numpy sum over each bytes field, the same
for every library, checked against the sum of the generated payload), so
bytes mapped lazily are not counted as delivered without being read. LitData and
MosaicML Streaming read their own formats, converted from the same samples
into as many chunks as there are tar shards. Each run is one epoch in a fresh
subprocess; runs are interleaved (A B C A B C ...) and medians are reported.
Nothing is downloaded at run time.

`--storage s3` reads the same files from a local S3 server instead
(`shardstream-bench-s3 serve`, s3s-fs with its chunk size, TCP_NODELAY and
ETag defects fixed; `benches/peers/s3server`), optionally behind its latency
proxy (`--first-byte-ms`, `--mbps` per connection). Each library uses its own
S3 path: shardstream its client, webdataset `pipe:curl --aws-sigv4`, LitData
(obstore) and MosaicML Streaming (boto3) into a fresh local cache per run. HF
datasets is left out: its streaming webdataset builder opens files with
`block_size=0`, which s3fs hands on to `AioSession` (a TypeError).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from make_dataset import make_dataset  # noqa: E402

BATCH = 32
SHUFFLE_BUFFER = 1000
SEED = 0
CHILD_TIMEOUT = 1800.0
BASELINE = "webdataset"
LIBRARIES = (
    "shardstream",
    "shardstream (Rust batches)",
    "shardstream (packed batches)",
    "webdataset",
    "litdata",
    "mosaicml-streaming",
    "hf-datasets",
)
# Full size and --quick size of each profile: shards, samples per shard.
# Audio: 4,096 samples (330 MB), so that an epoch at 2 workers lasts several
# times the DataLoader's own start (forking the workers, ~70 ms for every
# library), which at 64 per shard was up to half of shardstream's epoch.
PROFILES = {
    "audio": {"full": (16, 256), "quick": (4, 8)},
    "small": {"full": (8, 25_000), "quick": (4, 500)},
    "jpeg": {"full": (16, 256), "quick": (4, 8)},
}
SMALL_TEXT_BYTES = 200
# The JPEG profile: image size, JPEG quality, and the range of the noise's
# standard deviation (about 40-50 KB per image at these settings).
JPEG_SIZE = (320, 240)
JPEG_QUALITY = 90
JPEG_NOISE = (20.0, 32.0)
# Profiles whose consumer sums every byte of every bytes field it is given.
TOUCHED_PROFILES = {"jpeg"}
# Fields the sum leaves out, for every library: the label, which HF datasets'
# webdataset builder always parses into a number.
UNSUMMED_FIELDS = ("cls",)
# S3 mode: the bucket, the credentials of the local server, and the
# environment variable that hands its endpoint to the runs.
S3_BUCKET = "bench"
S3_KEY, S3_SECRET, S3_REGION = "shardstream", "shardstream-secret", "us-east-1"
S3_ENDPOINT_ENV = "PEERS_BENCH_S3_ENDPOINT"
S3_SERVER = ROOT / "build" / "s3server-target" / "release" / "shardstream-bench-s3"
SERVER_START_TIMEOUT = 30.0
METHOD = """\
How it is measured:

- Each run is one epoch in a fresh subprocess, timed from constructing the dataset to
  the last batch, through `torch.utils.data.DataLoader` (batch 32, `collate_fn=list`;
  "shardstream (Rust batches)": `batch_size=32` on the dataset, `DataLoader(batch_size=None)`;
  "shardstream (packed batches)": the same with `pack_bytes=True`, each bytes field of a
  batch one uint8 array plus its offsets, and the DataLoader's default conversion, which
  turns them into tensors that leave workers through shared memory).
  Page cache warm. Every library shuffles its own way: a 1000-sample buffer (shardstream,
  webdataset `.shuffle(1000)`, HF `.shuffle(buffer_size=1000)`), LitData and MosaicML
  `shuffle=True`.
- The consumer keeps each batch's keys; on the "jpeg" profile it also sums every byte of
  every bytes field but the `.cls` label, which HF datasets parses into a number
  (`numpy.frombuffer(...).sum()`, the same for every library), and a run whose sum
  differs from the generated payload's fails.
- MB/s and CPU s/GB count the samples' payload (the fields' bytes, the same for every
  library). CPU is user+sys of the run and its DataLoader workers (`getrusage` SELF
  once the iterator is dropped + CHILDREN once the workers are joined, less the CPU
  spent before the dataset is constructed, i.e. imports; the harness's own
  `gc.collect()` after the epoch, about 0.1 s of walking torch's objects for every
  library, is not counted). Peak RSS: the main process's and the largest worker's.
- Duplicates / missing: the `__key__`s seen against the keys generated (worst run).
- Read amplification = bytes read / size on disk of the library's own copy of the data.
  Bytes read are deltas of `/proc/self/io` counters in the main process while the dataset
  is constructed, plus in the process that iterates it (the main process with 0 workers,
  else each worker, which sends its deltas back after its last sample) from its first to
  its last sample. "read()" uses `rchar` in the timed runs: every byte returned by
  read() and the like, page-cache hits included, so it sees re-reads; it does not see
  mmap'd files. "device" uses `read_bytes` in one extra, untimed run per cell after the
  library's files were dropped from the page cache (`posix_fadvise(DONTNEED)`): it sees
  mmap'd reads too, but not re-reads of pages already cached, and it counts kernel
  read-ahead (up to the file's end). Both count the small non-data reads in those windows
  (the worker's index-queue pipe, `/proc/self/io`, modules loaded lazily) and miss reads
  the main process makes while workers iterate (they cannot be told from the batches
  arriving over pipes) and reads by other processes.
"""
S3_METHOD = """
From S3: the same objects are served by one server process on this machine, which
takes CPU from the readers; its CPU is not counted. No cold-cache run: the server
reads from the page cache. LitData and MosaicML Streaming download whole chunks into
a local cache (emptied before each run) and read them from there. Read
amplification is the bytes of every GetObject the server answered during the run
(from its log) over the bytes of the library's copy of the data, with the number of
GETs; the `/proc/self/io` counters are not used, since socket reads bypass them.
"""


# ---------------------------------------------------------------- generation


def write_tar(path: Path, members: Iterator[tuple[str, bytes]]) -> None:
    """Writes a tar with fixed metadata, via a temporary file."""
    tmp = path.with_name(path.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, path)


def make_small(out: Path, shards: int, per_shard: int, seed: int = SEED) -> list[Path]:
    """Tar shards of samples with a 200-byte `.txt` and a `.cls` label."""
    out.mkdir(parents=True, exist_ok=True)
    letters = b"abcdefghijklmnopqrstuvwxyz     "
    paths = []
    for shard in range(shards):
        rng = random.Random(f"{seed}-small-{shard}")

        def members(shard: int = shard, rng: random.Random = rng) -> Iterator[tuple[str, bytes]]:
            for i in range(per_shard):
                key = f"small-{shard:06d}-{i:06d}"
                yield f"{key}.txt", bytes(rng.choices(letters, k=SMALL_TEXT_BYTES))
                yield f"{key}.cls", b"%d" % rng.randrange(10)

        path = out / f"shard-{shard:06d}.tar"
        write_tar(path, members())
        paths.append(path)
    return paths


def make_jpeg(out: Path, shards: int, per_shard: int, seed: int = SEED) -> list[Path]:
    """Tar shards of samples with a `.jpg` (a real JPEG, PIL-encoded from a
    gradient plus seeded Gaussian noise: ~45 KB) and a `.cls` label."""
    import numpy as np
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    width, height = JPEG_SIZE
    y, x = np.mgrid[0:height, 0:width]
    paths = []
    for shard in range(shards):

        def members(shard: int = shard) -> Iterator[tuple[str, bytes]]:
            for i in range(per_shard):
                rng = np.random.default_rng([seed, shard, i])
                phase = rng.integers(0, 256, 3)
                base = np.stack(
                    [
                        (x * 255 // width + phase[0]) % 256,
                        (y * 255 // height + phase[1]) % 256,
                        ((x + y) * 255 // (width + height) + phase[2]) % 256,
                    ],
                    axis=-1,
                )
                noise = rng.normal(0.0, rng.uniform(*JPEG_NOISE), (height, width, 3))
                pixels = np.clip(base + noise, 0, 255).astype(np.uint8)
                encoded = io.BytesIO()
                Image.fromarray(pixels).save(encoded, format="JPEG", quality=JPEG_QUALITY)
                key = f"jpeg-{shard:06d}-{i:06d}"
                yield f"{key}.jpg", encoded.getvalue()
                yield f"{key}.cls", b"%d" % int(rng.integers(1000))

        path = out / f"shard-{shard:06d}.tar"
        write_tar(path, members())
        paths.append(path)
    return paths


def byte_sum(sample: dict[str, Any]) -> int:
    """The sum of every byte of the sample's bytes fields but the label
    (numpy, reading each byte once): what the consumer of a touched profile
    computes."""
    import numpy as np

    total = 0
    for name, value in sample.items():
        if name.startswith("__") or name in UNSUMMED_FIELDS:
            continue
        if isinstance(value, (bytes, bytearray, memoryview)):
            total += int(np.frombuffer(value, dtype=np.uint8).sum(dtype=np.uint64))
    return total


def read_tar_samples(path: Path) -> Iterator[dict[str, Any]]:
    """Samples of a tar shard by the WebDataset rule, fields as bytes."""
    sample: dict[str, Any] = {}
    with tarfile.open(path, "r|") as tar:
        for member in tar:
            if not member.isreg():
                continue
            head, _, base = member.name.rpartition("/")
            stem, dot, field = base.partition(".")
            if not dot:
                continue
            key = f"{head}/{stem}" if head else stem
            if sample and sample["__key__"] != key:
                yield sample
                sample = {}
            sample["__key__"] = key
            file = tar.extractfile(member)
            assert file is not None
            sample[field.lower()] = file.read()
    if sample:
        yield sample


def generate(profile: str, root: Path, quick: bool) -> Path:
    """Writes a profile's tar shards and `meta.json` (keys, payload bytes)
    under `root/profile`, unless already there with the same parameters.
    Otherwise the directory is emptied first, so that no conversion or
    cache of other parameters is taken for this data."""
    shards, per_shard = PROFILES[profile]["quick" if quick else "full"]
    data = root / profile
    meta_path = data / "meta.json"
    params: dict[str, Any] = {
        "profile": profile,
        "shards": shards,
        "per_shard": per_shard,
        "seed": SEED,
    }
    if profile in TOUCHED_PROFILES:
        params["unsummed"] = list(UNSUMMED_FIELDS)
    if meta_path.exists() and json.loads(meta_path.read_text())["params"] == params:
        return data
    shutil.rmtree(data, ignore_errors=True)
    tars = data / "tar"
    if profile == "audio":
        paths = make_dataset(tars, shards=shards, samples_per_shard=per_shard, seed=SEED)
    elif profile == "jpeg":
        paths = make_jpeg(tars, shards, per_shard)
    else:
        paths = make_small(tars, shards, per_shard)
    keys, payload, total = [], 0, 0
    for path in paths:
        for sample in read_tar_samples(path):
            keys.append(sample["__key__"])
            payload += sum(len(v) for k, v in sample.items() if k != "__key__")
            if profile in TOUCHED_PROFILES:
                total += byte_sum(sample)
    meta = {
        "params": params,
        "keys": keys,
        "payload_bytes": payload,
        "byte_sum": total if profile in TOUCHED_PROFILES else None,
        "fields": sorted(k for k in next(read_tar_samples(paths[0])) if k != "__key__"),
    }
    meta_path.write_text(json.dumps(meta))
    return data


def load_meta(data: Path) -> dict[str, Any]:
    """The profile's `meta.json`."""
    return json.loads((data / "meta.json").read_text())


def tar_paths(data: Path) -> list[Path]:
    """The profile's tar shards, sorted."""
    return sorted((data / "tar").glob("*.tar"))


def chunk_bytes(data: Path) -> int:
    """Chunk size for the converted formats: about one chunk per tar shard."""
    tars = tar_paths(data)
    return max(1 << 16, -(-load_meta(data)["payload_bytes"] // len(tars)))


def _litdata_samples(path: str) -> Iterator[dict[str, Any]]:
    yield from read_tar_samples(Path(path))


def convert_litdata(data: Path) -> Path:
    """The samples in LitData's chunked format (`litdata.optimize`)."""
    out = data / "litdata"
    if (out / "index.json").exists():
        return out
    import litdata

    tmp = data / "litdata.tmp"
    litdata.optimize(
        fn=_litdata_samples,
        inputs=[str(p) for p in tar_paths(data)],
        output_dir=str(tmp),
        chunk_bytes=chunk_bytes(data),
        num_workers=1,
        reorder_files=False,
        mode="overwrite",
        verbose=False,
        start_method="fork",
    )
    os.replace(tmp, out)
    return out


def convert_mds(data: Path) -> Path:
    """The samples in MosaicML Streaming's MDS format (`MDSWriter`)."""
    out = data / "mds"
    if (out / "index.json").exists():
        return out
    from streaming import MDSWriter

    fields = load_meta(data)["fields"]
    columns = {"__key__": "str", **dict.fromkeys(fields, "bytes")}
    tmp = data / "mds.tmp"
    with MDSWriter(out=str(tmp), columns=columns, size_limit=chunk_bytes(data)) as writer:
        for path in tar_paths(data):
            for sample in read_tar_samples(path):
                writer.write(sample)
    os.replace(tmp, out)
    return out


# ---------------------------------------------------------------- one run


def io_counters() -> tuple[int, int]:
    """This process's `rchar` (bytes returned by read() and the like) and
    `read_bytes` (bytes it made the kernel fetch from the device) so far."""
    with open("/proc/self/io", "rb") as f:
        fields = dict(line.split(b":") for line in f.read().splitlines())
    return int(fields[b"rchar"]), int(fields[b"read_bytes"])


def io_since(start: tuple[int, int]) -> tuple[int, int]:
    """`io_counters()` now minus `start`."""
    now = io_counters()
    return now[0] - start[0], now[1] - start[1]


def evict(paths: list[Path]) -> None:
    """Drops the files from the page cache (after writing back dirty pages)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _identity(batch: Any) -> Any:
    return batch


# What each reader uses, as (module, attribute); attributes a package loads
# lazily are touched before measuring, so that loading their modules is not
# counted as bytes read while the dataset is constructed.
USES = {
    "shardstream": [("shardstream", "StreamingDataset")],
    "webdataset": [("webdataset", "WebDataset"), ("webdataset", "split_by_worker")],
    "litdata": [("litdata", "StreamingDataset")],
    "mosaicml-streaming": [
        ("streaming", "StreamingDataset"),
        ("streaming.base.util", "clean_stale_shared_memory"),
    ],
    "hf-datasets": [
        ("datasets", "load_dataset"),
        ("datasets.packaged_modules.webdataset.webdataset", "WebDataset"),
    ],
}


def import_library(library: str) -> None:
    """Imports what a reader needs, before anything is measured."""
    import importlib

    import torch.utils.data  # noqa: F401

    for module, attribute in USES[library.split(" ")[0]]:
        getattr(importlib.import_module(module), attribute)


def library_version(library: str) -> str:
    """The version of the package behind a reader."""
    from importlib.metadata import PackageNotFoundError, version

    package = {
        "litdata": "litdata",
        "mosaicml-streaming": "mosaicml-streaming",
        "hf-datasets": "datasets",
        "webdataset": "webdataset",
    }.get(library, "shardstream")
    try:
        return version(package)
    except PackageNotFoundError:
        if package != "shardstream":
            raise
        # A source tree on PYTHONPATH rather than an installed wheel.
        import shardstream

        return f"{shardstream.__version__} (source tree)"


def s3_endpoint() -> str | None:
    """The S3 endpoint of this run, or None when reading local files."""
    return os.environ.get(S3_ENDPOINT_ENV) or None


def s3_url(data: Path, sub: str) -> str:
    """The `s3://` URL of a profile's directory `sub` on the bench server."""
    return f"s3://{S3_BUCKET}/{data.name}/{sub}"


def make_dataset_for(
    library: str, data: Path, cache: Path, options: dict[str, Any] | None = None
) -> tuple[Any, dict[str, Any]]:
    """The library's dataset over the profile (local files, or the S3 server
    when `s3_endpoint()` is set), and the DataLoader's batching. `cache` is
    an empty directory for the libraries that download into a local cache.
    `options`: more keyword arguments of shardstream's `StreamingDataset`."""
    batching: dict[str, Any] = {"batch_size": BATCH, "collate_fn": list}
    endpoint = s3_endpoint()
    tars = [str(p) for p in tar_paths(data)]
    if endpoint:
        sigv4 = (
            f"--aws-sigv4 aws:amz:{S3_REGION}:s3 --user {S3_KEY}:{S3_SECRET} "
            "-H 'x-amz-content-sha256: UNSIGNED-PAYLOAD'"
        )
        prefix = f"{endpoint}/{S3_BUCKET}/{data.name}/tar"
        tar_urls = [f"pipe:curl -s -f {sigv4} {prefix}/{Path(p).name}" for p in tars]
    if library.startswith("shardstream"):
        from shardstream import S3Config, StreamingDataset

        batched = library in ("shardstream (Rust batches)", "shardstream (packed batches)")
        source = s3_url(data, "tar/") if endpoint else str(data / "tar")
        dataset = StreamingDataset(
            source,
            seed=SEED,
            shuffle_buffer=SHUFFLE_BUFFER,
            batch_size=BATCH if batched else None,
            pack_bytes=library == "shardstream (packed batches)",
            s3=S3Config(endpoint_url=endpoint, path_style=True) if endpoint else None,
            **(options or {}),
        )
        if library == "shardstream (packed batches)":
            # The DataLoader's default conversion: the packed numpy arrays
            # leave workers as tensors in shared memory.
            return dataset, {"batch_size": None}
        return dataset, {"batch_size": None, "collate_fn": _identity} if batched else batching
    if library == "webdataset":
        import webdataset as wds

        dataset = wds.WebDataset(
            tar_urls if endpoint else tars,
            shardshuffle=False,
            workersplitter=wds.split_by_worker,
            seed=SEED,
        ).shuffle(SHUFFLE_BUFFER)
        return dataset, batching
    if library == "litdata":
        import litdata

        if endpoint:
            from litdata.streaming import downloader

            # LitData downloads chunks through obstore with fixed client
            # options, which refuse a plain-http endpoint; allow it (the only
            # change: real S3 is https).
            downloader._OBSTORE_CLIENT_OPTIONS = {
                **downloader._OBSTORE_CLIENT_OPTIONS,
                "allow_http": True,
            }
        dataset = litdata.StreamingDataset(
            s3_url(data, "litdata") if endpoint else str(data / "litdata"),
            cache_dir=str(cache),
            shuffle=True,
            seed=SEED,
            storage_options={"endpoint_url": endpoint} if endpoint else None,
        )
        return dataset, batching
    if library == "mosaicml-streaming":
        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        dataset = StreamingDataset(
            local=str(cache) if endpoint else str(data / "mds"),
            remote=s3_url(data, "mds") if endpoint else None,
            shuffle=True,
            shuffle_seed=SEED,
            batch_size=BATCH,
        )
        return dataset, batching
    if library == "hf-datasets":
        from datasets import Audio, Image, Value, Video, load_dataset

        files = {"train": tars}
        inferred = load_dataset("webdataset", data_files=files, split="train", streaming=True)
        # Media fields (here .wav) as plain binary keeps their bytes: the Audio
        # feature would need torchcodec even with decoding off. The builder
        # itself always parses .json, .txt and .cls fields.
        features = inferred.features.copy()
        for name, feature in features.items():
            if isinstance(feature, (Audio, Image, Video)):
                features[name] = Value("binary")
        dataset = load_dataset(
            "webdataset", data_files=files, split="train", streaming=True, features=features
        ).shuffle(seed=SEED, buffer_size=SHUFFLE_BUFFER)
        return dataset, batching
    raise ValueError(f"unknown library {library!r}")


def _measured_dataset(inner: Any) -> Any:
    """`inner` wrapped so that each process iterating it yields, after its last
    item, a marker with its I/O counters' deltas over its iteration."""
    from torch.utils.data import IterableDataset

    class Measured(IterableDataset):
        def __iter__(self) -> Iterator[Any]:
            start = io_counters()
            yield from inner
            yield {"__io__": io_since(start), "__pid__": os.getpid()}

    return Measured()


def run_epoch(data: Path, library: str, num_workers: int, cold: bool = False) -> dict[str, Any]:
    """One epoch in this process; returns the measurements. `cold` first drops
    the library's copy of the dataset from the page cache."""
    import multiprocessing

    from torch.utils.data import DataLoader

    import_library(library)
    meta = load_meta(data)
    if cold:
        evict(library_files(library, data))
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=data))
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    io0 = io_counters()
    inner, batching = make_dataset_for(library, data, cache)
    construct_io = io_since(io0)
    loader = DataLoader(_measured_dataset(inner), num_workers=num_workers, **batching)
    keys: list[str] = []
    iteration_io: list[tuple[int, int]] = []
    touch = data.name in TOUCHED_PROFILES
    touched = 0
    batches = iter(loader)
    for batch in batches:
        if isinstance(batch, dict):
            if "__io__" in batch:
                iteration_io.append(batch["__io__"])
            else:
                keys.extend(batch["__key__"])
                if touch:
                    # Rust batches: each field a list of values; packed
                    # batches: each bytes field one uint8 array (summed
                    # whole), beside its offsets.
                    for name, column in batch.items():
                        if name.startswith("__") or name.endswith("_offsets"):
                            continue
                        if hasattr(column, "numpy"):  # a tensor
                            column = column.numpy()
                        if hasattr(column, "dtype"):
                            touched += byte_sum({name: memoryview(column)})
                        else:
                            touched += sum(byte_sum({name: value}) for value in column)
            continue
        if batch and "__io__" in batch[-1]:
            iteration_io.append(batch.pop()["__io__"])
        keys.extend(sample["__key__"] for sample in batch)
        if touch:
            touched += sum(byte_sum(sample) for sample in batch)
    elapsed = time.perf_counter() - start
    # Dropping the iterator ends the library's threads and joins the
    # DataLoader's workers; this process's CPU is taken before the
    # collection below, which walks every object torch made (about 0.1 s,
    # the same for every library), and the workers' once they are gone.
    del batches
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    gc.collect()
    deadline = time.monotonic() + 60
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (
        usage1.ru_utime
        + usage1.ru_stime
        - usage0.ru_utime
        - usage0.ru_stime
        + children1.ru_utime
        + children1.ru_stime
        - children0.ru_utime
        - children0.ru_stime
    )
    shutil.rmtree(cache, ignore_errors=True)
    expected = set(meta["keys"])
    seen = Counter(keys)
    stats = inner.stats() if library.startswith("shardstream") else {}
    exact = len(keys) == len(expected) == len(seen)
    if touch and exact and touched != meta["byte_sum"]:
        raise RuntimeError(
            f"{library}: the bytes delivered sum to {touched}, the generated ones to "
            f"{meta['byte_sum']}: some bytes were altered"
        )
    return {
        "library": library,
        "version": library_version(library),
        "num_workers": num_workers,
        "samples": len(keys),
        "expected_samples": len(meta["keys"]),
        "payload_bytes": meta["payload_bytes"],
        "seconds": elapsed,
        "cpu_seconds": cpu,
        # The main process alone (with workers: what it spends receiving
        # batches, the part that does not scale with workers).
        "cpu_main_seconds": usage1.ru_utime + usage1.ru_stime - usage0.ru_utime - usage0.ru_stime,
        "rss_main_mb": usage1.ru_maxrss / 1024,
        "rss_worker_mb": children1.ru_maxrss / 1024 if num_workers else 0.0,
        "duplicates": sum(n - 1 for n in seen.values() if n > 1),
        "missing": len(expected - seen.keys()),
        "unexpected": sum(n for k, n in seen.items() if k not in expected),
        "cold_cache": cold,
        "storage": "s3" if s3_endpoint() else "local",
        "construct_io": construct_io,
        "iteration_io": iteration_io,
        "rchar_bytes": construct_io[0] + sum(io[0] for io in iteration_io),
        "device_read_bytes": construct_io[1] + sum(io[1] for io in iteration_io),
        "disk_bytes": sum(p.stat().st_size for p in library_files(library, data)),
        "shardstream_bytes_read": stats.get("bytes_read"),
        "byte_sum": touched if touch else None,
    }


def library_files(library: str, data: Path) -> list[Path]:
    """The files of the library's copy of the dataset."""
    sub = {"litdata": "litdata", "mosaicml-streaming": "mds"}.get(library, "tar")
    return sorted(p for p in (data / sub).rglob("*") if p.is_file())


def child_env(data_root: Path, endpoint: str | None = None) -> dict[str, str]:
    """Environment of the runs: offline, caches under the data directory, and
    the S3 server's endpoint and credentials when reading from S3."""
    env = dict(os.environ)
    if endpoint:
        env.update(
            {
                S3_ENDPOINT_ENV: endpoint,
                "AWS_ACCESS_KEY_ID": S3_KEY,
                "AWS_SECRET_ACCESS_KEY": S3_SECRET,
                "AWS_DEFAULT_REGION": S3_REGION,
                "AWS_REGION": S3_REGION,
                "AWS_ENDPOINT_URL": endpoint,
                "S3_ENDPOINT_URL": endpoint,
            }
        )
    env.update(
        HF_HOME=str(data_root / "hf-home"),
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_DATASETS_DISABLE_PROGRESS_BARS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def measure(
    python: str,
    data: Path,
    library: str,
    num_workers: int,
    *,
    cold: bool = False,
    timeout: float = CHILD_TIMEOUT,
    endpoint: str | None = None,
) -> dict[str, Any]:
    """Runs `run_epoch` in a fresh subprocess of `python` (reading from the
    S3 server at `endpoint` if given)."""
    command = [python, __file__, "--child", str(data), library, str(num_workers)]
    out = subprocess.run(
        [*command, *(["--cold"] if cold else [])],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(data.parent, endpoint),
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"{library} (num_workers={num_workers}) failed with {out.returncode}:\n"
            f"{out.stderr[-4000:]}"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def convert(python: str, data: Path, kind: str) -> None:
    """Converts the profile to `kind` ("litdata" or "mds") in a subprocess."""
    subprocess.run(
        [python, __file__, "--convert", kind, str(data)],
        check=True,
        timeout=CHILD_TIMEOUT,
        env=child_env(data.parent),
    )


def warm(data: Path) -> None:
    """Reads every file of the profile once, so the page cache is warm."""
    for path in sorted(data.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass


# ---------------------------------------------------------------- S3 server


class ServerLog:
    """Reads the bench S3 server's stdout on a thread: its address, then a
    `get BUCKET/KEY OFFSET LENGTH` line per GetObject, added up."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.address: str | None = None
        self.gets = 0
        self.get_bytes = 0
        self._ready = threading.Event()
        self._last_line = time.monotonic()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._thread.start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            words = line.split()
            with self._lock:
                self._last_line = time.monotonic()
                if words[:2] == ["listening", "on"]:
                    self.address = words[-1]
                    self._ready.set()
                elif words[:1] == ["get"] and len(words) == 4:
                    self.gets += 1
                    self.get_bytes += int(words[3])
        self._ready.set()

    def wait_address(self, what: str) -> str:
        """The `http://ADDR` the server listens on (waits at most
        SERVER_START_TIMEOUT seconds)."""
        self._ready.wait(SERVER_START_TIMEOUT)
        if self.address is None:
            raise RuntimeError(f"{what} did not start within {SERVER_START_TIMEOUT:.0f} s")
        return self.address

    def counts(self, quiet: float = 0.3, limit: float = 10.0) -> tuple[int, int]:
        """(GetObject requests, bytes requested) so far, once the log has been
        quiet for `quiet` seconds (at most `limit` seconds of waiting)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            with self._lock:
                if time.monotonic() - self._last_line >= quiet:
                    return self.gets, self.get_bytes
            time.sleep(quiet / 3)
        with self._lock:
            return self.gets, self.get_bytes


def publish(root: Path, data: Path) -> None:
    """Hard-links the profile's tar shards and converted copies into the S3
    server's root, as objects `S3_BUCKET/<profile>/...`, in place of what
    was published for the profile before."""
    shutil.rmtree(root / S3_BUCKET / data.name, ignore_errors=True)
    for sub in ("tar", "litdata", "mds"):
        if not (data / sub).is_dir():
            continue
        for path in sorted((data / sub).rglob("*")):
            if path.is_file():
                target = root / S3_BUCKET / data.name / path.relative_to(data)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(path, target)


@contextlib.contextmanager
def s3_server(root: Path, first_byte_ms: int, mbps: float) -> Iterator[tuple[str, ServerLog]]:
    """Runs the bench S3 server over `root` (and the latency proxy in front
    of it when `first_byte_ms` or `mbps` is set); yields the endpoint and
    the server's log."""
    if not S3_SERVER.exists():
        sys.exit(f"error: {S3_SERVER} not found (make bench-peers-s3 builds it)")
    keys = ["--access-key", S3_KEY, "--secret-key", S3_SECRET]
    serve = [str(S3_SERVER), "serve", "--root", str(root), "--addr", "127.0.0.1:0", *keys]
    processes: list[subprocess.Popen[str]] = []
    try:
        processes.append(subprocess.Popen(serve, stdout=subprocess.PIPE, text=True))
        log = ServerLog(processes[-1])
        endpoint = log.wait_address("the S3 server")
        if first_byte_ms or mbps:
            proxy = [str(S3_SERVER), "proxy", "--listen", "127.0.0.1:0"]
            proxy += ["--upstream", endpoint.removeprefix("http://")]
            proxy += ["--first-byte-ms", str(first_byte_ms), "--mbps", f"{mbps:g}"]
            processes.append(subprocess.Popen(proxy, stdout=subprocess.PIPE, text=True))
            endpoint = ServerLog(processes[-1]).wait_address("the latency proxy")
        yield endpoint, log
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


def head_all(root: Path, endpoint: str) -> None:
    """HEADs every object once, so the server has computed their ETags before
    any run is timed."""
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=S3_KEY,
        aws_secret_access_key=S3_SECRET,
        region_name=S3_REGION,
    )
    for path in sorted((root / S3_BUCKET).rglob("*")):
        if path.is_file():
            client.head_object(Bucket=S3_BUCKET, Key=str(path.relative_to(root / S3_BUCKET)))


# ---------------------------------------------------------------- report


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of a cell's timed runs (worst duplicates and missing of all its
    runs), and the device read amplification of its cold-cache run."""
    timed = [r for r in runs if not r["cold_cache"]]
    cold = [r for r in runs if r["cold_cache"]]
    payload, disk = runs[0]["payload_bytes"], runs[0]["disk_bytes"]
    med = statistics.median
    return {
        "samples_per_s": med(r["samples"] / r["seconds"] for r in timed),
        "mb_per_s": med(payload / 1e6 / r["seconds"] for r in timed),
        "cpu_s_per_gb": med(r["cpu_seconds"] / (payload / 1e9) for r in timed),
        "rss_main_mb": med(r["rss_main_mb"] for r in timed),
        "rss_worker_mb": med(r["rss_worker_mb"] for r in timed),
        "duplicates": max(r["duplicates"] for r in runs),
        "missing": max(r["missing"] for r in runs),
        "unexpected": max(r["unexpected"] for r in runs),
        "read_amplification": med(r.get("s3_get_bytes", r["rchar_bytes"]) / disk for r in timed),
        "s3_gets": med(r["s3_gets"] for r in timed) if "s3_gets" in timed[0] else None,
        "device_amplification": med(r["device_read_bytes"] / disk for r in cold) if cold else None,
        "disk_bytes": disk,
        "samples": runs[0]["expected_samples"],
        "payload_bytes": payload,
        "version": runs[0]["version"],
        "runs": len(timed),
    }


def any_timed(runs: list[dict[str, Any]]) -> bool:
    """Whether a cell has a timed (not cold-cache) run to summarize."""
    return any(not r["cold_cache"] for r in runs)


def last_line(text: str) -> str:
    """The last non-empty line of `text` (a traceback's exception)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else text


def failed_runs(failures: dict[tuple[str, int, str], list[str]]) -> str:
    """Markdown lines naming each cell with failed runs and the last error."""
    if not failures:
        return ""
    lines = ["", "", "Failed runs (left out of the medians):", ""]
    for (profile, workers, library), reasons in failures.items():
        lines.append(
            f"- {library}, {profile}, {workers} workers: {len(reasons)} run(s) failed; "
            f"last error: `{reasons[-1]}`"
        )
    return "\n".join(lines)


def best_peer_ratios(
    cells: dict[tuple[str, int, str], list[dict[str, Any]]],
) -> dict[tuple[str, int, str], tuple[float, list[float]]]:
    """Each shardstream cell against the fastest peer of its repetition: per
    repetition, its samples/s over the highest samples/s any other library
    reached in that repetition (runs are interleaved, so the k-th timed runs
    of the cells of one profile and worker count ran side by side); the
    median of those ratios and the ratios themselves."""

    def rates(runs: list[dict[str, Any]]) -> list[float]:
        return [r["samples"] / r["seconds"] for r in runs if not r["cold_cache"]]

    ratios = {}
    for (profile, workers, library), runs in cells.items():
        if not library.startswith("shardstream"):
            continue
        peers = [
            rates(other)
            for (p, w, name), other in cells.items()
            if (p, w) == (profile, workers) and not name.startswith("shardstream")
        ]
        ours = rates(runs)
        per_repetition = [
            ours[k] / max(peer[k] for peer in peers if k < len(peer))
            for k in range(len(ours))
            if any(k < len(peer) for peer in peers)
        ]
        if per_repetition:
            ratios[(profile, workers, library)] = (
                statistics.median(per_repetition),
                per_repetition,
            )
    return ratios


def best_peer_table(ratios: dict[tuple[str, int, str], tuple[float, list[float]]]) -> str:
    """The ratios of `best_peer_ratios` as a Markdown table."""
    if not ratios:
        return ""
    lines = [
        "",
        "",
        "shardstream against the fastest peer of each repetition (samples/s; median of the "
        "per-repetition ratios, then each repetition's):",
        "",
        "| profile | workers | library | x best peer | per repetition |",
        "|---|---|---|---|---|",
    ]
    for (profile, workers, library), (median, each) in ratios.items():
        runs = ", ".join(f"{r:.2f}" for r in each)
        lines.append(f"| {profile} | {workers} | {library} | {median:.2f}x | {runs} |")
    return "\n".join(lines)


def ratio(value: float, base: float | None) -> str:
    """`value` over `base`, as "1.23x"."""
    return f"{value / base:.2f}x" if base else "-"


def markdown(results: dict[tuple[str, int, str], dict[str, Any]], header: str) -> str:
    """The results as Markdown tables."""
    s3 = any(s["s3_gets"] is not None for s in results.values())
    amplification = "GET bytes / object bytes (GETs)" if s3 else "read() / device"
    lines = [
        header,
        "",
        "| profile | workers | library | samples/s | vs webdataset | MB/s | CPU s/GB "
        "| vs webdataset | peak RSS main / worker (MB) | duplicates / missing "
        f"| read amplification: {amplification} |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (profile, workers, library), s in results.items():
        base = results.get((profile, workers, BASELINE))
        worker = f"{s['rss_worker_mb']:,.0f}" if workers else "-"
        device = s["device_amplification"]
        second = f"{device:.2f}" if device is not None else "-"
        if s["s3_gets"] is not None:
            second = f"({s['s3_gets']:,.0f})"
        lines.append(
            f"| {profile} | {workers} | {library} | {s['samples_per_s']:,.0f} | "
            f"{ratio(s['samples_per_s'], base and base['samples_per_s'])} | "
            f"{s['mb_per_s']:,.1f} | {s['cpu_s_per_gb']:,.1f} | "
            f"{ratio(s['cpu_s_per_gb'], base and base['cpu_s_per_gb'])} | "
            f"{s['rss_main_mb']:,.0f} / {worker} | {s['duplicates']} / {s['missing']} | "
            f"{s['read_amplification']:.2f} {'' if s3 else '/ '}{second} |"
        )
    mapped = sorted(
        {
            library
            for (_, _, library), s in results.items()
            if s["read_amplification"] < 0.5 and (s["device_amplification"] or 0) >= 0.9
        }
    )
    if mapped:
        lines += [
            "",
            f"{', '.join(mapped)}: read() amplification near 0 with device amplification "
            "near 1 means the files are read through mmap, which `rchar` does not see.",
        ]
    lines += ["", "| profile | library | version | samples | payload MB | on disk MB |"]
    lines.append("|---|---|---|---|---|---|")
    done = set()
    for (profile, _, library), s in results.items():
        if (profile, library) not in done:
            done.add((profile, library))
            lines.append(
                f"| {profile} | {library} | {s['version']} | {s['samples']:,} | "
                f"{s['payload_bytes'] / 1e6:,.1f} | {s['disk_bytes'] / 1e6:,.1f} |"
            )
    return "\n".join(lines)


def plot(results: dict[tuple[str, int, str], dict[str, Any]], path: Path, title: str) -> None:
    """Bar chart of samples/s per profile x workers x library."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import StrMethodFormatter

    profiles = list(dict.fromkeys(k[0] for k in results))
    workers = sorted({k[1] for k in results})
    libraries = list(dict.fromkeys(k[2] for k in results))
    fig, axes = plt.subplots(1, len(profiles), figsize=(6.5 * len(profiles), 5), squeeze=False)
    width = 0.8 / len(libraries)
    colors = plt.get_cmap("tab10").colors
    for ax, profile in zip(axes[0], profiles, strict=True):
        for i, library in enumerate(libraries):
            xs, ys = [], []
            for j, w in enumerate(workers):
                cell = results.get((profile, w, library))
                if cell:
                    xs.append(j + (i - (len(libraries) - 1) / 2) * width)
                    ys.append(cell["samples_per_s"])
            bars = ax.bar(xs, ys, width, label=library, color=colors[i % len(colors)])
            ax.bar_label(bars, labels=[f"{y:,.0f}" for y in ys], fontsize=7, rotation=90, padding=2)
        ax.set_xticks(range(len(workers)), [f"num_workers={w}" for w in workers])
        ax.set_ylabel("samples/s (median)")
        ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
        ax.set_title(f"{profile}")
        ax.margins(y=0.2)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--quick", action="store_true", help="tiny profiles, 1 repetition")
    parser.add_argument("--profiles", nargs="+", choices=list(PROFILES), default=list(PROFILES))
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--libraries", nargs="+", choices=LIBRARIES, default=list(LIBRARIES))
    parser.add_argument(
        "--mds-python",
        default=str(ROOT / ".venv-peers-mds" / "bin" / "python"),
        help="Python of the MosaicML Streaming virtualenv",
    )
    parser.add_argument("--timeout", type=float, default=CHILD_TIMEOUT, help="seconds per run")
    parser.add_argument(
        "--no-cold-run", action="store_true", help="skip the cold-cache run of each cell"
    )
    parser.add_argument(
        "--storage",
        choices=["local", "s3"],
        default="local",
        help="read local files (page cache warm) or from the local S3 server",
    )
    parser.add_argument(
        "--first-byte-ms",
        type=int,
        default=0,
        help="S3: put the latency proxy in front, delaying each response's first byte",
    )
    parser.add_argument(
        "--mbps", type=float, default=0.0, help="S3: proxy bandwidth cap per connection (MB/s)"
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--convert", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        data, library, workers = args.child
        print(json.dumps(run_epoch(Path(data), library, int(workers), cold=args.cold)))
        return
    if args.convert:
        kind, data = args.convert
        (convert_litdata if kind == "litdata" else convert_mds)(Path(data))
        return

    repeats = args.repeats or (1 if args.quick else 3)
    root = args.out / ("peers-data-quick" if args.quick else "peers-data")
    pythons = {lib: sys.executable for lib in args.libraries}
    if "mosaicml-streaming" in args.libraries:
        if not Path(args.mds_python).exists():
            sys.exit(f"error: {args.mds_python} not found (make bench-peers installs it)")
        pythons["mosaicml-streaming"] = args.mds_python
    datas = []
    for profile in args.profiles:
        data = generate(profile, root, args.quick)
        if "litdata" in args.libraries:
            convert(sys.executable, data, "litdata")
        if "mosaicml-streaming" in args.libraries:
            convert(pythons["mosaicml-streaming"], data, "mds")
        datas.append(data)
    s3 = args.storage == "s3"
    if s3 and "hf-datasets" in args.libraries:
        print(
            "--storage s3: leaving out hf-datasets, whose webdataset builder cannot "
            "stream from s3:// (it passes block_size=0, which s3fs rejects)",
            file=sys.stderr,
        )
        args.libraries.remove("hf-datasets")
    cells: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    failures: dict[tuple[str, int, str], list[str]] = {}
    with contextlib.ExitStack() as stack:
        endpoint, log = None, None
        if s3:
            s3_root = root / "s3root"
            for data in datas:
                publish(s3_root, data)
            server = s3_server(s3_root, args.first_byte_ms, args.mbps)
            endpoint, log = stack.enter_context(server)
            head_all(s3_root, endpoint)
        for data in datas:
            warm(data)
            for workers in args.workers:
                rounds = [(False, rep) for rep in range(repeats)]
                if not (args.no_cold_run or s3):
                    rounds.insert(0, (True, 0))
                for cold, rep in rounds:
                    for library in args.libraries:
                        before = log.counts() if log else (0, 0)
                        cell = (data.name, workers, library)
                        what = "cold-cache run" if cold else f"run {rep + 1}/{repeats}"
                        try:
                            result = measure(
                                pythons[library],
                                data,
                                library,
                                workers,
                                cold=cold,
                                timeout=args.timeout,
                                endpoint=endpoint,
                            )
                        except (RuntimeError, subprocess.TimeoutExpired) as error:
                            # A library's failure is reported, not fatal.
                            reason = last_line(str(error))
                            failures.setdefault(cell, []).append(reason)
                            print(
                                f"{data.name} workers={workers} {what} {library}: FAILED: {reason}",
                                file=sys.stderr,
                                flush=True,
                            )
                            continue
                        if log:
                            after = log.counts()
                            result["s3_gets"] = after[0] - before[0]
                            result["s3_get_bytes"] = after[1] - before[1]
                        cells.setdefault(cell, []).append(result)
                        print(
                            f"{data.name} workers={workers} {what} {library}: "
                            f"{result['samples'] / result['seconds']:,.0f} samples/s, "
                            f"{result['duplicates']} duplicates, {result['missing']} missing",
                            file=sys.stderr,
                            flush=True,
                        )
                    if cold:
                        warm(data)
    results = {key: summarize(runs) for key, runs in cells.items() if any_timed(runs)}
    machine = f"{os.cpu_count()} cores, Python {sys.version.split()[0]}"
    where, stem = "local files", "peers"
    if s3:
        proxied = args.first_byte_ms or args.mbps
        where = "the local S3 server (`shardstream-bench-s3 serve`" + (
            f" behind its latency proxy: first byte +{args.first_byte_ms:g} ms per request, "
            f"{args.mbps:g} MB/s per connection)"
            if proxied
            else ", no added latency)"
        )
        stem = "peers-s3-proxy" if proxied else "peers-s3"
    header = (
        f"# shardstream and its peers, reading {where}\n\n{machine}; median of {repeats} "
        f"run(s) per cell{' (--quick: tiny profiles)' if args.quick else ''}; ratios are to "
        f"webdataset (samples/s: higher is better; CPU s/GB: lower is better).\n\n{METHOD}"
    )
    if s3:
        header += S3_METHOD
    table = markdown(results, header) + best_peer_table(best_peer_ratios(cells))
    table += failed_runs(failures)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.md").write_text(table + "\n")
    (args.out / f"{stem}.json").write_text(
        json.dumps({" | ".join(map(str, k)): v for k, v in cells.items()}, indent=1)
    )
    title = f"One epoch through DataLoader from {'S3' if s3 else 'local files'} ({machine})"
    plot(results, args.out / f"{stem}.png", title)
    print(table)
    print(f"\nwrote {args.out / (stem + '.md')} and {args.out / (stem + '.png')}")


if __name__ == "__main__":
    main()

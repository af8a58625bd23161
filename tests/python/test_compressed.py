"""Compressed shards: ``.tar.gz``/``.tgz`` and ``.tar.zst``, told by their
magic bytes, through DataLoader workers, directories, manifests with
several ranks, exact resume, ``inspect``, and corrupt or truncated
streams under both error policies.

Expected samples are read from the plain tars with ``tarfile``; the
compressed shards are written here with Python's ``gzip`` and
``zstandard``."""

from __future__ import annotations

import gzip
import json
import random
import warnings
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
import zstandard
from _shardtest import (
    DatasetInfo,
    ExpectedSample,
    assert_exactly_once,
    collect,
    index_manifest,
    key_batch,
    keys_of,
    load_schema,
    loader,
    member_offsets,
    read_tar_samples,
    sample_digest,
    shardstream_cli,
    tar_bytes,
    tar_sample_spans,
    uneven_members,
    write_tar,
)
from torchdata.stateful_dataloader import StatefulDataLoader

import shardstream
from shardstream import ShardFormatError, ShardSkippedWarning

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

MANIFEST_VALIDATOR = jsonschema.Draft202012Validator(load_schema("manifest"))
SUFFIXES = {"gz": ".tar.gz", "tgz": ".tgz", "zst": ".tar.zst", "tar": ".tar"}
RECORDED = {".tar.gz": "gzip", ".tgz": "gzip", ".tar.zst": "zstd", ".tar": None}


def compress(data: bytes, suffix: str) -> bytes:
    """``data`` as a shard named ``*suffix`` is usually stored. zstd frames
    carry a checksum, as the ``zstd`` command writes them by default."""
    if suffix in (".tar.gz", ".tgz"):
        return gzip.compress(data, mtime=0)
    if suffix == ".tar.zst":
        return zstandard.ZstdCompressor(level=3, write_checksum=True).compress(data)
    return data


def compressed_copy(plain: Path, directory: Path, suffix: str) -> Path:
    """``plain`` (a ``.tar``) compressed as ``directory/<stem><suffix>``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (plain.name.removesuffix(".tar") + suffix)
    path.write_bytes(compress(plain.read_bytes(), suffix))
    return path


def copy_dataset(info: DatasetInfo, directory: Path, suffixes: list[str]) -> DatasetInfo:
    """``info``'s shards, shard ``i`` stored as ``suffixes[i % len]``; the
    expected samples are the plain tars' under the new URLs."""
    paths = [
        compressed_copy(plain, directory, suffixes[i % len(suffixes)])
        for i, plain in enumerate(info.paths)
    ]
    samples = [
        ExpectedSample(str(path), s.key, s.fields)
        for plain, path in zip(info.paths, paths, strict=True)
        for s in read_tar_samples(plain)
    ]
    return DatasetInfo(directory, paths, str(directory), samples)


def assert_same_samples(got: list[dict], info: DatasetInfo) -> None:
    """Every expected sample exactly once, with the very bytes and URL."""
    assert_exactly_once(keys_of(got), info.keys)
    expected = info.by_key()
    for sample in got:
        want = expected[sample["__key__"]]
        assert sample["__url__"] == want.url
        assert sample_digest(sample) == want.digest()


@pytest.mark.parametrize("kind", ["gz", "tgz", "zst"])
def test_compressed_shards_through_dataloader_workers(kind, dataset, tmp_path):
    info = copy_dataset(dataset, tmp_path / kind, [SUFFIXES[kind]])
    ds = shardstream.StreamingDataset(info.spec, seed=4, shuffle_buffer=5)
    assert shardstream.resolve_shards([info.spec]) == [
        (f"{info.spec}/{p.name}", p.stat().st_size) for p in info.paths
    ]
    got = collect(loader(ds, 2))
    assert_same_samples(got, info)
    stats = ds.stats()
    assert stats["shards_completed"] == len(info.paths)
    # bytes_read counts the bytes fetched from storage: the compressed ones.
    assert stats["bytes_read"] == sum(info.sizes)
    assert sum(info.sizes) < sum(dataset.sizes)


def test_mixed_directory(dataset, tmp_path):
    root = tmp_path / "mixed"
    info = copy_dataset(dataset, root, [".tar", ".tar.gz", ".tar.zst", ".tgz"])
    (root / "notes.txt").write_text("not a shard")
    (root / "loose.gz").write_bytes(gzip.compress(b"not a shard either"))
    listed = [url for url, _ in shardstream.resolve_shards([str(root)])]
    assert listed == sorted(str(p) for p in info.paths)
    assert {Path(u).name.partition(".")[2] for u in listed} == {"tar", "tar.gz", "tar.zst", "tgz"}
    ds = shardstream.StreamingDataset(root, seed=9)
    assert_same_samples(collect(loader(ds, 2)), info)


@pytest.mark.parametrize(
    ("name", "stored_as"),
    [
        ("gzip-named.tar", ".tar.gz"),
        ("zstd-named.tar", ".tar.zst"),
        ("plain-named.tar.gz", ".tar"),
        ("plain-named.tar.zst", ".tar"),
        ("zstd-named.tgz", ".tar.zst"),
    ],
)
def test_compression_is_told_by_the_bytes_not_the_name(name, stored_as, dataset, tmp_path):
    plain = dataset.paths[3]
    path = tmp_path / name
    path.write_bytes(compress(plain.read_bytes(), stored_as))
    got = collect(shardstream.StreamingDataset(path, shuffle_buffer=0))
    assert keys_of(got) == dataset.keys_of([str(plain)])
    expected = {s.key: s.digest() for s in read_tar_samples(plain)}
    assert all(sample_digest(s) == expected[s["__key__"]] for s in got)


# --------------------------------------------------------------------------
# Manifests, ranks and resume
# --------------------------------------------------------------------------

UNEVEN = (7, 31, 2, 0, 19, 23)


@pytest.fixture(scope="module")
def compressed_uneven(tmp_path_factory) -> DatasetInfo:
    """Shards of 7, 31, 2, 0, 19 and 23 samples stored as gzip, zstd and
    plain tars in turn, indexed into ``manifest.json`` beside them."""
    plain_root = tmp_path_factory.mktemp("uneven-plain")
    plains = [
        write_tar(plain_root / f"part-{i:06d}.tar", uneven_members(i, n, seed=3))
        for i, n in enumerate(UNEVEN)
    ]
    root = tmp_path_factory.mktemp("uneven-compressed")
    info = copy_dataset(
        DatasetInfo(plain_root, plains, str(plain_root), []),
        root,
        [".tar.gz", ".tar.zst", ".tar"],
    )
    index_manifest([root], root / "manifest.json")
    return info


def test_index_records_compression_and_decompressed_offsets(compressed_uneven, tmp_path):
    info = compressed_uneven
    manifest = json.loads((info.root / "manifest.json").read_text())
    MANIFEST_VALIDATOR.validate(manifest)
    entries = {entry["url"]: entry for entry in manifest["shards"]}
    assert sorted(entries) == sorted(p.name for p in info.paths)
    for path in info.paths:
        entry = entries[path.name]
        assert entry.get("compression") == RECORDED["." + path.name.partition(".")[2]]
        assert entry["size"] == path.stat().st_size
        # Offsets and lengths are those of the decompressed tar.
        plain = tmp_path / "plain.tar"
        plain.write_bytes(read_decompressed(path))
        spans = tar_sample_spans(plain)
        assert entry["samples"] == len(spans)
        assert entry["offsets"] == [offset for _, offset, _ in spans]
        assert entry["lengths"] == [length for _, _, length in spans]


def read_decompressed(path: Path) -> bytes:
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data)
    if data[:4] == b"\x28\xb5\x2f\xfd":
        return zstandard.ZstdDecompressor().decompress(data)
    return data


@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_manifest_gives_two_ranks_equal_lengths(compressed_uneven, remainder):
    info = compressed_uneven
    total = len(info.keys)
    per_rank = []
    lengths = set()
    for rank in range(2):
        ds = shardstream.StreamingDataset(
            info.spec, rank=rank, world_size=2, seed=6, shuffle_buffer=8, remainder=remainder
        )
        assert ds.manifest_path == str(info.root / "manifest.json")
        ds.set_epoch(1)
        lengths.add(len(ds))
        per_rank.append(keys_of(collect(loader(ds, 2))))
    (length,) = lengths
    assert [len(keys) for keys in per_rank] == [length, length]
    counts = Counter(k for keys in per_rank for k in keys)
    assert counts.keys() <= set(info.keys)
    if remainder == "drop":
        assert length == total // 2
        assert all(n == 1 for n in counts.values())
    else:
        assert length == -(-total // 2)
        assert counts.keys() == set(info.keys)


def resumable_loader(info: DatasetInfo, num_workers: int, manifest: bool) -> StatefulDataLoader:
    ds = shardstream.StreamingDataset(
        info.spec, seed=5, shuffle_buffer=7, manifest=None if manifest else False
    )
    ds.set_epoch(2)
    return StatefulDataLoader(
        ds, batch_size=4, num_workers=num_workers, collate_fn=key_batch, timeout=120
    )


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_exact_resume_mid_epoch(compressed_uneven, manifest):
    info = compressed_uneven
    full = collect(resumable_loader(info, 2, manifest))
    assert_exactly_once([k for batch in full for k in batch], info.keys)
    k = len(full) // 2
    first = resumable_loader(info, 2, manifest)
    iterator = iter(first)
    prefix = [next(iterator) for _ in range(k)]
    state = json.loads(json.dumps(first.state_dict()))
    del iterator, first
    assert prefix == full[:k]
    resumed = resumable_loader(info, 2, manifest)
    resumed.load_state_dict(state)
    assert prefix + collect(resumed) == full


def test_manifest_compression_must_match_the_bytes(compressed_uneven, tmp_path):
    """A manifest that calls a plain shard gzip (or a gzip shard plain) is
    a mismatch, found when the shard is opened."""
    info = compressed_uneven
    manifest = json.loads((info.root / "manifest.json").read_text())
    for entry in manifest["shards"]:
        entry["url"] = str(info.root / entry["url"])
        if entry["samples"] and entry.get("compression") is None:
            entry["compression"] = "gzip"
            wrong = entry["url"]
    edited = tmp_path / "manifest.json"
    edited.write_text(json.dumps(manifest))
    MANIFEST_VALIDATOR.validate(manifest)
    ds = shardstream.StreamingDataset(info.spec, manifest=str(edited), shuffle_buffer=0)
    with pytest.raises(shardstream.ManifestMismatchError) as raised:
        collect(ds)
    message = str(raised.value)
    assert wrong in message and "the manifest says a gzip stream" in message, message


# --------------------------------------------------------------------------
# Corrupt and truncated streams
# --------------------------------------------------------------------------


def corrupt(data: bytes) -> bytes:
    """``data`` with bytes flipped a third of the way in (inside the
    compressed blocks, past the stream's header)."""
    at = len(data) // 3
    bad = bytearray(data)
    for i in range(at, at + 16):
        bad[i] ^= 0xA5
    return bytes(bad)


BAD_KINDS = ["gz-truncated", "zst-truncated", "gz-corrupt", "zst-corrupt", "tgz-truncated"]


def make_bad(kind: str, plain: Path, directory: Path) -> tuple[Path, str]:
    """A bad compressed shard and the word its error must use."""
    fmt, _, damage = kind.partition("-")
    suffix = SUFFIXES[fmt]
    data = compress(plain.read_bytes(), suffix)
    data = data[: len(data) // 2] if damage == "truncated" else corrupt(data)
    path = directory / f"bad-{kind}{suffix}"
    path.write_bytes(data)
    return path, damage


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_stream_raises_shard_format_error(kind, dataset, tmp_path):
    path, damage = make_bad(kind, dataset.paths[0], tmp_path)
    ds = shardstream.StreamingDataset(path, shuffle_buffer=0)
    with pytest.raises(ShardFormatError) as info:
        collect(ds)
    message = str(info.value)
    assert str(path) in message
    name = "zstd" if kind.startswith("zst") else "gzip"
    assert f"{damage} {name} stream" in message, message
    assert "compressed byte offset" in message and "of the decompressed stream" in message


@pytest.mark.parametrize("kind", ["gz-truncated", "zst-corrupt"])
def test_bad_stream_raises_through_dataloader_workers(kind, dataset, tmp_path):
    path, _ = make_bad(kind, dataset.paths[0], tmp_path)
    ds = shardstream.StreamingDataset([*dataset.urls[1:4], str(path)], seed=3)
    with pytest.raises(ShardFormatError) as info:
        collect(loader(ds, 2))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_warn_policy_skips_a_bad_compressed_shard(kind, dataset, tmp_path):
    path, _ = make_bad(kind, dataset.paths[0], tmp_path)
    good = copy_dataset(
        DatasetInfo(dataset.root, dataset.paths[1:5], dataset.spec, []),
        tmp_path / "good",
        [".tar.gz", ".tar.zst"],
    )
    urls = [*good.urls, str(path)]
    ds = shardstream.StreamingDataset(urls, seed=1, shuffle_buffer=0, on_error="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = keys_of(collect(ds))
    skipped = [w for w in caught if issubclass(w.category, ShardSkippedWarning)]
    assert len(skipped) == 1 and str(path) in str(skipped[0].message)
    good_keys = set(good.keys)
    assert_exactly_once([k for k in got if k in good_keys], good.keys)
    # What came from the bad shard are samples decoded before the damage.
    bad_keys = dataset.keys_of([str(dataset.paths[0])])
    from_bad = [k for k in got if k not in good_keys]
    assert from_bad == bad_keys[: len(from_bad)] and len(from_bad) < len(bad_keys)
    stats = ds.stats()
    assert stats["errors_skipped"] == 1
    assert stats["shards_completed"] == len(good.paths)


def test_warn_policy_through_dataloader_workers(dataset, tmp_path):
    path, _ = make_bad("zst-truncated", dataset.paths[0], tmp_path)
    good = copy_dataset(
        DatasetInfo(dataset.root, dataset.paths[1:5], dataset.spec, []),
        tmp_path / "good",
        [".tgz"],
    )
    ds = shardstream.StreamingDataset([*good.urls, str(path)], seed=2, on_error="warn")
    got = keys_of(collect(loader(ds, 2, multiprocessing_context="fork")))
    assert_exactly_once([k for k in got if k in set(good.keys)], good.keys)
    assert ds.stats()["errors_skipped"] == 1


def test_truncated_tar_inside_a_complete_gzip_stream(dataset, tmp_path):
    """The stream is fine, the tar it holds is cut: a tar error whose offset
    is said to be in the decompressed tar."""
    data = dataset.paths[0].read_bytes()
    cut = len(data) // 2 + 100
    path = tmp_path / "cut-inside.tar.gz"
    path.write_bytes(gzip.compress(data[:cut], mtime=0))
    with pytest.raises(ShardFormatError) as info:
        collect(shardstream.StreamingDataset(path, shuffle_buffer=0))
    message = str(info.value)
    assert "truncated tar archive" in message
    assert f"byte offset {cut} of the decompressed gzip stream" in message, message


def test_zero_padding_after_a_gzip_stream_is_skipped_as_gzip_does(dataset, tmp_path):
    """A ``.tar.gz`` followed by zeros (a tape block's padding, which
    Python's ``gzip`` and the ``gzip`` command skip): every sample, once,
    with its bytes; ``index`` and a manifest read it too. Zeros then bytes
    that are no gzip member still raise."""
    padded = tmp_path / "padded"
    info = copy_dataset(dataset, padded, [".tar.gz"])
    for path in info.paths:
        path.write_bytes(path.read_bytes() + bytes(10240 - path.stat().st_size % 10240))
        assert gzip.decompress(path.read_bytes()) == (
            dataset.paths[info.paths.index(path)].read_bytes()
        )
    assert_same_samples(collect(shardstream.StreamingDataset(padded, shuffle_buffer=0)), info)
    index_manifest([str(padded)], tmp_path / "manifest.json")
    ds = shardstream.StreamingDataset(padded, shuffle_buffer=0, manifest=tmp_path / "manifest.json")
    assert_same_samples(collect(ds), info)
    bad = info.paths[0]
    bad.write_bytes(bad.read_bytes() + b"not a gzip member")
    with pytest.raises(ShardFormatError, match=bad.name):
        collect(shardstream.StreamingDataset(bad, shuffle_buffer=0))


# --------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gz", "zst", "tar"])
def test_inspect_compressed_shard(kind, dataset, tmp_path):
    plain = dataset.paths[2]
    path = compressed_copy(plain, tmp_path, SUFFIXES[kind])
    proc = shardstream_cli("inspect", path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.rstrip("\n").split("\n")
    expected = read_tar_samples(plain)
    assert [line.partition("\t")[0] for line in lines[:-1]] == [s.key for s in expected]
    stored = {"gz": "gzip-compressed", "zst": "zstd-compressed", "tar": "uncompressed"}[kind]
    assert lines[-1].startswith(f"{len(expected)} samples, ")
    assert f"{path.stat().st_size} bytes in the shard ({stored})" in lines[-1]


# --------------------------------------------------------------------------
# Checksums: no sample decoded from bytes that then fail one
# --------------------------------------------------------------------------

NOISE_SAMPLES = 8
NOISE_SIZE = 3000


def noise_members(count: int = NOISE_SAMPLES, seed: int = 0) -> list[tuple[str, bytes]]:
    """One-member samples ``n000.bin``, ... of random bytes, which no
    compressor shrinks: stored blocks and raw literals keep them as they
    are, so a bit flipped in the compressed bytes flips one decoded bit
    that only the stream's checksum notices."""
    rng = random.Random(seed)
    return [(f"n{i:03d}.bin", rng.randbytes(NOISE_SIZE)) for i in range(count)]


def stored_gzip(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=0, mtime=0)


def zstd_frame(data: bytes, checksum: bool = True) -> bytes:
    return zstandard.ZstdCompressor(level=3, write_checksum=checksum).compress(data)


def flip_in(compressed: bytes, needle: bytes) -> bytes:
    """``compressed`` with one bit flipped in the middle of the first copy of
    ``needle``, decoded bytes that the stream holds as they are."""
    at = compressed.find(needle)
    assert at >= 0, "the needle is stored as it is"
    damaged = bytearray(compressed)
    damaged[at + len(needle) // 2] ^= 0x10
    return bytes(damaged)


def damaged_shard(path: Path, compress_tar, member: int = 3, count: int = NOISE_SAMPLES) -> Path:
    """A shard of ``noise_members(count)`` compressed by ``compress_tar``, with
    one bit flipped in the data of member ``member``."""
    members = noise_members(count)
    needle = members[member][1][1000:1032]
    path.write_bytes(flip_in(compress_tar(tar_bytes(members)), needle))
    return path


CHECKSUMMED = {"gz": stored_gzip, "zst": zstd_frame}


def iterate_until_error(ds) -> tuple[list[dict], BaseException | None]:
    """The samples ``ds`` yields before it raises, and what it raised."""
    got: list[dict] = []
    try:
        for sample in ds:
            got.append(sample)
    except shardstream.ShardStreamError as exc:
        return got, exc
    return got, None


@pytest.mark.parametrize("kind", sorted(CHECKSUMMED))
def test_no_sample_is_yielded_before_the_checksum_that_fails(kind, tmp_path):
    """The damage shows only at the stream's CRC-32 / content checksum: the
    damaged sample, and every sample of the member or frame, is held back
    until then, so none is yielded."""
    path = damaged_shard(tmp_path / f"flipped{SUFFIXES[kind]}", CHECKSUMMED[kind])
    got, error = iterate_until_error(shardstream.StreamingDataset(path, shuffle_buffer=0))
    assert keys_of(got) == []
    assert isinstance(error, ShardFormatError), error
    name = "gzip" if kind == "gz" else "zstd"
    assert f"corrupt {name} stream" in str(error) and str(path) in str(error), error
    assert "handed out" not in str(error)


@pytest.mark.parametrize("kind", sorted(CHECKSUMMED))
def test_warn_keeps_no_sample_of_a_stream_whose_checksum_fails(kind, tmp_path):
    bad = damaged_shard(tmp_path / f"flipped{SUFFIXES[kind]}", CHECKSUMMED[kind])
    good = tmp_path / f"good{SUFFIXES[kind]}"
    good.write_bytes(CHECKSUMMED[kind](tar_bytes(noise_members(5, seed=1))))
    ds = shardstream.StreamingDataset(
        [str(good), str(bad)], shuffle_shards=False, shuffle_buffer=0, on_error="warn"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = collect(ds)
    assert [s["__url__"] for s in got] == [str(good)] * 5
    assert [s["bin"] for s in got] == [data for _, data in noise_members(5, seed=1)]
    skipped = [w for w in caught if issubclass(w.category, ShardSkippedWarning)]
    assert len(skipped) == 1 and str(bad) in str(skipped[0].message)
    assert ds.stats()["errors_skipped"] == 1


def test_samples_of_verified_gzip_members_are_kept(tmp_path):
    """Members are checked one by one: a damaged second member costs its
    own samples (and the last one of the first, which the second member's
    first header ends), not those the first member's CRC-32 covers."""
    members = noise_members()
    plain = tar_bytes(members)
    split = member_offsets(plain)["n004.bin"][0] - 512  # n004's header
    needle = members[5][1][1000:1032]
    path = tmp_path / "two-members.tar.gz"
    path.write_bytes(stored_gzip(plain[:split]) + flip_in(stored_gzip(plain[split:]), needle))
    ds = shardstream.StreamingDataset(path, shuffle_buffer=0, on_error="warn")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got = collect(ds)
    assert keys_of(got) == ["n000", "n001", "n002"]
    assert [s["bin"] for s in got] == [data for _, data in members[:3]]


@pytest.mark.parametrize("suffix", [".tar.gz", ".tar.zst"])
def test_a_stream_cut_at_a_member_boundary_is_reported_as_truncated(suffix, tmp_path):
    """A shard of several gzip members (or zstd frames) cut where one ends:
    every member that is left passes its checksum, but the tar they decode
    to ends without its end-of-archive blocks. Before, it read as a shorter
    archive, the samples of the members cut off lost without a word."""
    plain = tar_bytes(noise_members())
    split = member_offsets(plain)["n004.bin"][0] - 512  # n004's header
    path = tmp_path / f"cut{suffix}"
    path.write_bytes(compress(plain[:split], suffix))
    with pytest.raises(ShardFormatError) as info:
        collect(shardstream.StreamingDataset(path, shuffle_buffer=0))
    message = str(info.value)
    assert "truncated tar archive" in message and "end-of-archive" in message, message
    assert f"byte offset {split} of the decompressed" in message, message


def test_a_member_larger_than_the_verify_budget_says_what_was_handed_out(tmp_path):
    """Samples wait for the checksum within ``read_ahead_bytes`` of decoded
    tar; past that they are yielded unverified, and the checksum's failure
    says how many were."""
    path = damaged_shard(tmp_path / "long.tar.gz", stored_gzip, member=20, count=24)
    ds = shardstream.StreamingDataset(path, shuffle_buffer=0, read_ahead_bytes=16 << 10)
    got, error = iterate_until_error(ds)
    assert isinstance(error, ShardFormatError), error
    assert 10 <= len(got) < 24
    note = f"{len(got)} samples of this shard had already been handed out before the checksum"
    assert note in str(error), error
    # With room for the whole member, nothing is.
    ds = shardstream.StreamingDataset(path, shuffle_buffer=0, read_ahead_bytes=1 << 20)
    assert iterate_until_error(ds)[0] == []


def test_zstd_without_a_checksum_is_not_verified(tmp_path):
    """What is not verified: a zstd frame written without a content checksum
    (``zstandard``'s default) has nothing that notices a flipped bit in its
    stored bytes, so the changed sample is yielded, without an error. Its
    samples are yielded as they are decoded."""
    members = noise_members()
    path = damaged_shard(tmp_path / "unchecked.tar.zst", lambda t: zstd_frame(t, checksum=False))
    got = collect(shardstream.StreamingDataset(path, shuffle_buffer=0))
    assert keys_of(got) == [name.removesuffix(".bin") for name, _ in members]
    changed = [s["__key__"] for s, (_, data) in zip(got, members, strict=True) if s["bin"] != data]
    assert changed == ["n003"]

"""Manifests: ``shardstream index`` output (schema, offsets and lengths against
``tarfile``), how datasets find and use them, equal-length ranks, the
``plan_samples`` cut, and manifests that do not match the data."""

from __future__ import annotations

import json
import math
import os
import re
import tarfile
import warnings
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
from _shardtest import (
    UNEVEN_COUNTS,
    DatasetInfo,
    assert_exactly_once,
    collect,
    epoch_sequence,
    index_manifest,
    keys_of,
    load_schema,
    loader,
    read_tar_samples,
    regular,
    sample_digest,
    shard_keys,
    shardstream_cli,
    special,
    tar_sample_spans,
    write_tar,
    write_uneven_dataset,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import shardstream
from shardstream import (
    ManifestError,
    ManifestIgnoredWarning,
    ManifestMismatchError,
    ShardFormatError,
)

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

MANIFEST_VALIDATOR = jsonschema.Draft202012Validator(load_schema("manifest"))
LONG_DIR = "speaker-" + "x" * 90 + "/session-" + "y" * 40
"""A member directory that makes every name under it longer than 100 bytes."""


def dataset(spec, **kwargs) -> shardstream.StreamingDataset:
    return shardstream.StreamingDataset(spec, **kwargs)


# --------------------------------------------------------------------------
# The index command and the manifest format
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["manifest", "state"])
def test_schema_files_are_valid_draft_2020_12(name):
    schema = load_schema(name)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)


def odd_tar_members(kind: str) -> tuple[list, dict]:
    """Members (and ``tar_bytes`` options) of tars whose sample spans are not
    just ``header + data``: GNU long names, PAX headers, entries between
    samples that belong to none, empty and block-sized members."""
    if kind == "gnu_long_names":
        members = [
            (f"{LONG_DIR}/first.wav", b"a" * 700),
            (f"{LONG_DIR}/first.json", b"{}"),
            ("short.wav", b"b" * 10),
            (f"short.{'e' * 120}", b"c" * 3),  # long name on the sample's last member
            (f"{LONG_DIR}/third.wav", b""),
        ]
        return members, {"format": tarfile.GNU_FORMAT}
    if kind == "pax_long_and_unicode":
        members = [
            ("plain.txt", b"p" * 512),
            (f"{LONG_DIR}/long.txt", b"l" * 513),
            (f"{LONG_DIR}/long.cls", b"1"),
            ("naïve-ünïcode.txt", b"u" * 1024),
            ("naïve-ünïcode.cls", b"2"),
        ]
        return members, {"format": tarfile.PAX_FORMAT}
    if kind == "pax_global_header":
        members = [("g1.txt", b"1" * 100), ("g1.cls", b"1"), ("g2.txt", b"2" * 1000)]
        return members, {"format": tarfile.PAX_FORMAT, "pax_headers": {"comment": "global"}}
    if kind == "entries_between_samples":
        members = [
            special("dir/", tarfile.DIRTYPE),
            ("dir/s1.txt", b"1" * 511),
            ("dir/s1.cls", b""),
            special("dir/s1.lnk", tarfile.SYMTYPE, "s1.txt"),
            ("README", b"no extension, no sample"),
            (".hidden", b"empty stem, no sample"),
            ("dir/s2.txt", b"2" * 512),
            regular("dir/s3.txt", 0),
            ("dir/s3.json", b"[]"),
        ]
        return members, {"format": tarfile.USTAR_FORMAT}
    if kind == "empty_archive":
        return [], {"format": tarfile.GNU_FORMAT}
    raise AssertionError(kind)


ODD_TARS = [
    "gnu_long_names",
    "pax_long_and_unicode",
    "pax_global_header",
    "entries_between_samples",
    "empty_archive",
]


def write_odd_tar(path: Path, kind: str) -> Path:
    members, options = odd_tar_members(kind)
    return write_tar(path, members, **options)


@pytest.mark.parametrize("kind", ODD_TARS)
def test_index_spans_match_tarfile(tmp_path, kind):
    path = write_odd_tar(tmp_path / f"{kind}.tar", kind)
    manifest = index_manifest([path], tmp_path / "manifest.json")
    MANIFEST_VALIDATOR.validate(manifest)
    assert manifest["format"] == "shardstream.manifest"
    assert manifest["version"] == 1
    (entry,) = manifest["shards"]
    stat = path.stat()
    assert entry["url"] == path.name  # inside the manifest's directory: relative
    assert entry["size"] == stat.st_size
    assert entry["mtime_ns"] == stat.st_mtime_ns
    spans = tar_sample_spans(path)
    assert entry["samples"] == len(spans) == len(read_tar_samples(path))
    assert entry["offsets"] == [offset for _, offset, _ in spans]
    assert entry["lengths"] == [length for _, _, length in spans]


@pytest.mark.parametrize("kind", [k for k in ODD_TARS if k != "empty_archive"])
def test_ranged_reads_of_odd_tars_give_the_tarfile_samples(tmp_path, kind):
    """Every cut of the shard (one rank per sample and more) starts its
    byte-range read at a manifest offset: long-name and PAX headers included."""
    path = write_odd_tar(tmp_path / f"{kind}.tar", kind)
    index_manifest([path], tmp_path / "manifest.json")
    expected = read_tar_samples(path)
    for world_size in range(1, len(expected) + 2):
        got = []
        for rank in range(world_size):
            ds = dataset(path, rank=rank, world_size=world_size, shuffle_buffer=0, remainder="pad")
            assert ds.manifest_path == str((tmp_path / "manifest.json").resolve())
            rank_samples = collect(ds)
            assert len(rank_samples) == len(ds) == math.ceil(len(expected) / world_size)
            got += rank_samples
        want = [expected[i % len(expected)] for i in range(len(got))]
        assert keys_of(got) == [s.key for s in want], world_size
        assert [sample_digest(s) for s in got] == [s.digest() for s in want]


def test_index_of_the_uneven_dataset(uneven_dataset: DatasetInfo):
    manifest = json.loads((uneven_dataset.root / "manifest.json").read_text())
    MANIFEST_VALIDATOR.validate(manifest)
    assert [e["url"] for e in manifest["shards"]] == [p.name for p in uneven_dataset.paths]
    assert [e["samples"] for e in manifest["shards"]] == list(UNEVEN_COUNTS)
    for entry, path in zip(manifest["shards"], uneven_dataset.paths, strict=True):
        spans = tar_sample_spans(path)
        assert entry["size"] == path.stat().st_size
        assert entry["offsets"] == [offset for _, offset, _ in spans]
        assert entry["lengths"] == [length for _, _, length in spans]


def test_index_urls_relative_inside_the_manifest_dir_absolute_outside(tmp_path):
    data = write_uneven_dataset(tmp_path / "data" / "sub", [2, 3])
    inside = index_manifest([data.root], tmp_path / "data" / "manifest.json")
    assert [e["url"] for e in inside["shards"]] == [f"sub/{p.name}" for p in data.paths]
    (tmp_path / "elsewhere").mkdir()
    outside = index_manifest([data.root], tmp_path / "elsewhere" / "manifest.json")
    assert [e["url"] for e in outside["shards"]] == [str(p.resolve()) for p in data.paths]
    for manifest in (inside, outside):
        MANIFEST_VALIDATOR.validate(manifest)
        assert [e["samples"] for e in manifest["shards"]] == [2, 3]
    # Both manifests work when named explicitly (neither is beside the shards).
    assert dataset(data.root).manifest_path is None
    for path in (tmp_path / "data" / "manifest.json", tmp_path / "elsewhere" / "manifest.json"):
        ds = dataset(data.root, manifest=path, shuffle_buffer=0, world_size=2, rank=1)
        assert ds.manifest_path == str(path)
        assert len(ds) == 2
        assert len(collect(ds)) == 2


def test_index_fails_cleanly_on_a_missing_shard(tmp_path):
    out = tmp_path / "manifest.json"
    proc = shardstream_cli("index", tmp_path / "missing.tar", "-o", out)
    assert proc.returncode != 0
    assert "missing.tar" in proc.stderr
    assert not out.exists()


# --------------------------------------------------------------------------
# Finding, disabling and naming the manifest
# --------------------------------------------------------------------------


def spec_forms(info: DatasetInfo) -> dict[str, object]:
    return {
        "brace": info.spec,
        "directory": str(info.root),
        "list": [str(p) for p in info.paths],
        "file_urls": [f"file://{p}" for p in info.paths],
    }


@pytest.mark.parametrize("form", ["brace", "directory", "list", "file_urls"])
def test_manifest_beside_the_shards_is_found(uneven_dataset, form):
    ds = dataset(spec_forms(uneven_dataset)[form])
    assert ds.manifest_path == str((uneven_dataset.root / "manifest.json").resolve())
    assert ds.shard_list.sample_counts == list(UNEVEN_COUNTS)
    assert len(ds) == sum(UNEVEN_COUNTS)
    assert_exactly_once(keys_of(collect(ds)), uneven_dataset.keys)


def test_manifest_false_disables_it(uneven_dataset):
    ds = dataset(uneven_dataset.spec, manifest=False, count_samples=False)
    assert ds.manifest_path is None
    assert ds.shard_list.sample_counts is None
    with pytest.raises(TypeError, match="manifest"):
        len(ds)
    # Counted from the headers instead, the counts are the manifest's.
    counted = dataset(uneven_dataset.spec, manifest=False, count_samples=True)
    assert counted.manifest_path is None
    assert counted.shard_list.sample_counts == list(UNEVEN_COUNTS)
    assert len(counted) == sum(UNEVEN_COUNTS)
    assert_exactly_once(keys_of(collect(ds)), uneven_dataset.keys)


def test_no_manifest_when_shards_span_directories(tmp_path, uneven_dataset):
    other = write_uneven_dataset(tmp_path / "other", [2], prefix="other")
    index_manifest([other.root], other.root / "manifest.json")
    ds = dataset([str(uneven_dataset.paths[0]), str(other.paths[0])], count_samples=False)
    assert ds.manifest_path is None
    with pytest.raises(TypeError):
        len(ds)


def test_explicit_manifest_elsewhere(tmp_path, uneven_dataset):
    path = tmp_path / "index" / "dataset-manifest.json"
    path.parent.mkdir()
    manifest = index_manifest([uneven_dataset.spec], path)
    assert [e["url"] for e in manifest["shards"]] == [
        str(p.resolve()) for p in uneven_dataset.paths
    ]
    for manifest_arg in (path, str(path)):
        ds = dataset(uneven_dataset.spec, manifest=manifest_arg, world_size=3, rank=2)
        assert ds.manifest_path == str(path)
        assert len(ds) == sum(UNEVEN_COUNTS) // 3
    # A subset of the listed shards is fine.
    ds = dataset(uneven_dataset.paths[1], manifest=path)
    assert len(ds) == UNEVEN_COUNTS[1]
    assert keys_of(collect(ds)) != []


# --------------------------------------------------------------------------
# Equal-length ranks
# --------------------------------------------------------------------------


def rank_keys_by_slots(
    spec, rank, world_size, num_workers, *, epoch=0, **kwargs
) -> tuple[list[str], int]:
    """One rank's keys, its workers simulated with explicit ``worker_id``s
    (worker by worker), and ``len()`` of its dataset."""
    keys: list[str] = []
    for worker_id in range(num_workers):
        ds = dataset(
            spec,
            rank=rank,
            world_size=world_size,
            num_workers=num_workers,
            worker_id=worker_id,
            **kwargs,
        )
        ds.set_epoch(epoch)
        keys += keys_of(collect(ds))
    return keys, len(ds)


def check_equal_ranks(per_rank: list[list[str]], length: int, info, remainder) -> None:
    world_size = len(per_rank)
    total = len(info.keys)
    assert [len(keys) for keys in per_rank] == [length] * world_size
    every = [key for keys in per_rank for key in keys]
    counts = Counter(every)
    if remainder == "drop":
        assert length == total // world_size
        assert len(counts) == len(every) == length * world_size, "a key came twice"
        assert counts.keys() <= set(info.keys)
    else:
        assert length == math.ceil(total / world_size)
        assert counts.keys() == set(info.keys)
        assert sum(n - 1 for n in counts.values()) == length * world_size - total


@pytest.mark.parametrize("remainder", ["drop", "pad"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_every_rank_yields_len_samples_explicit_slots(uneven_dataset, world_size, remainder):
    """Shards of 0..40 samples: every rank gets exactly ``len(ds)`` samples,
    for 1..3 workers (simulated with explicit ``worker_id``s); with "drop"
    the ranks together hold the epoch sequence without its last
    ``total % world_size`` samples."""
    seed, epoch = 21, 3
    sequence = epoch_sequence(uneven_dataset, seed=seed, epoch=epoch)
    assert sorted(sequence) == sorted(uneven_dataset.keys)
    for num_workers in (1, 2, 3):
        per_rank = []
        for rank in range(world_size):
            keys, length = rank_keys_by_slots(
                uneven_dataset.spec,
                rank,
                world_size,
                num_workers,
                epoch=epoch,
                seed=seed,
                shuffle_buffer=16,
                remainder=remainder,
            )
            per_rank.append(keys)
        check_equal_ranks(per_rank, length, uneven_dataset, remainder)
        if remainder == "drop":
            kept = sequence[: length * world_size]
            assert_exactly_once([k for keys in per_rank for k in keys], kept)


@pytest.mark.parametrize("remainder", ["drop", "pad"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_slots_concatenate_to_the_epoch_sequence(
    uneven_dataset, world_size, num_workers, remainder
):
    """Without a shuffle buffer, all slots' samples in slot order are the
    epoch sequence (drop: its first ``len * world_size``; pad: wrapped)."""
    seed, epoch = 4, 2
    sequence = epoch_sequence(uneven_dataset, seed=seed, epoch=epoch)
    every: list[str] = []
    for rank in range(world_size):
        for worker_id in range(num_workers):
            ds = dataset(
                uneven_dataset.spec,
                rank=rank,
                world_size=world_size,
                num_workers=num_workers,
                worker_id=worker_id,
                seed=seed,
                shuffle_buffer=0,
                remainder=remainder,
            )
            ds.set_epoch(epoch)
            every += keys_of(collect(ds))
    length = len(ds)
    assert len(every) == length * world_size
    assert every == [sequence[i % len(sequence)] for i in range(len(every))]
    if remainder == "drop":
        dropped = sequence[length * world_size :]
        assert len(dropped) == len(sequence) % world_size


@pytest.mark.parametrize("remainder", ["drop", "pad"])
@pytest.mark.parametrize(
    ("world_size", "num_workers"), [(1, 3), (2, 2), (3, 1), (3, 3), (4, 2), (5, 2)]
)
def test_every_rank_yields_len_samples_through_dataloader(
    uneven_dataset, world_size, num_workers, remainder
):
    per_rank = []
    for rank in range(world_size):
        ds = dataset(
            uneven_dataset.spec,
            rank=rank,
            world_size=world_size,
            seed=8,
            shuffle_buffer=16,
            remainder=remainder,
        )
        ds.set_epoch(1)
        keys = keys_of(collect(loader(ds, num_workers)))
        per_rank.append(keys)
    check_equal_ranks(per_rank, len(ds), uneven_dataset, remainder)
    if remainder == "drop":
        sequence = epoch_sequence(uneven_dataset, seed=8, epoch=1)
        kept = sequence[: len(ds) * world_size]
        assert_exactly_once([k for keys in per_rank for k in keys], kept)


def test_more_ranks_than_samples(tmp_path):
    info = write_uneven_dataset(tmp_path, [0, 2, 0, 1])
    index_manifest([info.root], info.root / "manifest.json")
    world_size = 7
    drop = [keys_of(collect(dataset(info.spec, rank=r, world_size=world_size))) for r in range(7)]
    assert drop == [[]] * world_size
    pad = [
        keys_of(collect(dataset(info.spec, rank=r, world_size=world_size, remainder="pad")))
        for r in range(world_size)
    ]
    assert [len(keys) for keys in pad] == [1] * world_size
    assert set(k for keys in pad for k in keys) == set(info.keys)


def test_all_shards_empty(tmp_path):
    info = write_uneven_dataset(tmp_path, [0, 0])
    index_manifest([info.root], info.root / "manifest.json")
    for remainder in ("drop", "pad"):
        for world_size in (1, 3):
            ds = dataset(info.spec, rank=0, world_size=world_size, remainder=remainder)
            assert len(ds) == 0
            assert collect(ds) == []


# --------------------------------------------------------------------------
# plan_samples
# --------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    counts=st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=30),
    world_size=st.integers(min_value=1, max_value=9),
    num_workers=st.integers(min_value=1, max_value=5),
    seed=st.integers(min_value=0, max_value=2**64 - 1),
    epoch=st.integers(min_value=0, max_value=2**32),
    shuffle_shards=st.booleans(),
    remainder=st.sampled_from(["drop", "pad"]),
)
def test_plan_samples_properties(
    counts, world_size, num_workers, seed, epoch, shuffle_shards, remainder
):
    kwargs = dict(seed=seed, epoch=epoch, shuffle_shards=shuffle_shards)
    slots = shardstream.plan_samples(
        counts, world_size=world_size, num_workers=num_workers, remainder=remainder, **kwargs
    )
    assert len(slots) == world_size * num_workers
    total = sum(counts)
    per_rank = total // world_size if remainder == "drop" else math.ceil(total / world_size)

    # The epoch order of shards: the single slot of a 1 x 1 plan by bytes.
    (order,) = shardstream.plan_epoch([1] * len(counts), world_size=1, num_workers=1, **kwargs)
    assert sorted(order) == list(range(len(counts)))
    sequence = [(shard, i) for shard in order for i in range(counts[shard])]

    sizes = []
    for slot in slots:
        for shard, start, end in slot:
            assert 0 <= start < end <= counts[shard], (shard, start, end)
        sizes.append(sum(end - start for _, start, end in slot))
    for rank in range(world_size):
        mine = sizes[rank * num_workers : (rank + 1) * num_workers]
        assert sum(mine) == per_rank
        assert max(mine) - min(mine) <= 1

    # Contiguous: concatenated in slot order, the pieces are the epoch
    # sequence's prefix (drop) or the sequence wrapped around (pad).
    flat = [(shard, i) for slot in slots for shard, start, end in slot for i in range(start, end)]
    assert len(flat) == per_rank * world_size
    if remainder == "drop":
        assert flat == sequence[: len(flat)]
        assert len(set(flat)) == len(flat)
    else:
        assert flat == [sequence[i % total] for i in range(len(flat))] if total else flat == []
        seen = Counter(flat)
        assert len(seen) == total
        assert sum(n - 1 for n in seen.values()) == per_rank * world_size - total


def test_plan_samples_rejects_bad_arguments():
    with pytest.raises((ValueError, shardstream.ShardStreamError)):
        shardstream.plan_samples([1, 2], seed=0, epoch=0, world_size=0, num_workers=1)
    with pytest.raises((ValueError, shardstream.ShardStreamError)):
        shardstream.plan_samples([1, 2], seed=0, epoch=0, world_size=1, num_workers=0)
    with pytest.raises((ValueError, shardstream.ShardStreamError)):
        shardstream.plan_samples(
            [1, 2], seed=0, epoch=0, world_size=1, num_workers=1, remainder="wrap"
        )


# --------------------------------------------------------------------------
# Manifests that do not match the data
# --------------------------------------------------------------------------

SIZES = [600, 100, 50, 1000]
"""Byte sizes of the ``.bin`` members of the mismatch tests' shard."""


def write_sized(path: Path, sizes, prefix: str = "s") -> Path:
    members = []
    for i, n in enumerate(sizes):
        members += [(f"{prefix}{i}.bin", bytes([i + 1]) * n), (f"{prefix}{i}.cls", b"c")]
    return write_tar(path, members)


@pytest.fixture
def indexed(tmp_path) -> tuple[Path, Path, Path]:
    """``a.tar`` (4 samples) and ``b.tar`` (2), with ``manifest.json`` beside them."""
    a = write_sized(tmp_path / "a.tar", SIZES, "a")
    b = write_sized(tmp_path / "b.tar", [10, 20], "b")
    index_manifest([a, b], tmp_path / "manifest.json")
    return a, b, tmp_path / "manifest.json"


def test_size_mismatch_fails_at_construction(indexed):
    a, b, manifest = indexed
    write_sized(a, [*SIZES, 3000], "a")  # one more sample: a bigger file
    for kwargs in ({}, {"manifest": manifest}):
        with pytest.raises(ManifestMismatchError, match=r"a\.tar") as info:
            dataset([str(a), str(b)], **kwargs)
        assert str(a.stat().st_size) in str(info.value)
    # Without the manifest the data is fine.
    assert len(collect(dataset([str(a), str(b)], manifest=False))) == 7


def test_unlisted_shard_fails_at_construction(indexed):
    a, _, manifest = indexed
    c = write_sized(a.parent / "c.tar", [5], "c")
    for kwargs in ({}, {"manifest": manifest}):
        with pytest.raises(ManifestMismatchError, match=r"c\.tar"):
            dataset(str(a.parent), **kwargs)
        with pytest.raises(ManifestMismatchError, match="not listed") as info:
            dataset([str(a), str(c)], **kwargs)
        # The way out is named: index the shards again.
        assert "shardstream index" in str(info.value), info.value


def assert_fails_or_true(ds, path: Path, truth: dict) -> bool:
    """Iterates ``ds``: either it fails with a manifest/format error naming
    ``path``, or every sample it yields is a real sample of the shard as it
    is now (nothing made up from the wrong bytes). Returns whether it failed."""
    try:
        samples = collect(ds)
    except (ManifestMismatchError, ShardFormatError) as exc:
        assert str(path) in str(exc)
        return True
    for sample in samples:
        assert sample["__key__"] in truth, sample["__key__"]
        assert sample_digest(sample) == truth[sample["__key__"]].digest()
    return False


def rewrite_keeping_size_and_mtime(a: Path, new_sizes) -> None:
    """``a`` rewritten with samples of ``new_sizes``, its size and
    modification time as they were: only its bytes tell."""
    before = a.stat()
    write_sized(a, new_sizes, "a")
    assert a.stat().st_size == before.st_size, "the test needs a same-size rewrite"
    os.utime(a, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.mark.parametrize(
    "new_sizes",
    [
        pytest.param([100, 600, 50, 1000], id="offsets-shifted"),
        pytest.param([100, 100], id="fewer-samples"),
        pytest.param([1500, 50, 50], id="one-sample-spans-two"),
    ],
)
def test_same_size_other_content_fails_during_iteration(indexed, new_sizes):
    a, b, _ = indexed
    rewrite_keeping_size_and_mtime(a, new_sizes)
    ds = dataset([str(a), str(b)], shuffle_shards=False, shuffle_buffer=0)  # constructs fine
    assert len(ds) == 6
    truth = {s.key: s for s in read_tar_samples(a) + read_tar_samples(b)}
    # One rank reading the whole shard must notice.
    assert assert_fails_or_true(ds, a, truth)
    # Cut anywhere: no rank yields a made-up sample.
    for world_size in range(2, 7):
        for rank in range(world_size):
            ds = dataset(
                [str(a), str(b)],
                shuffle_shards=False,
                shuffle_buffer=0,
                rank=rank,
                world_size=world_size,
            )
            assert_fails_or_true(ds, a, truth)


def test_other_content_through_a_dataloader_worker(indexed):
    a, b, _ = indexed
    rewrite_keeping_size_and_mtime(a, [100, 600, 50, 1000])
    ds = dataset([str(a), str(b)], shuffle_shards=False, shuffle_buffer=0)
    with pytest.raises(ManifestMismatchError, match=r"a\.tar"):
        collect(loader(ds, 1))


SCHEMA_INVALID = [
    "not-json",
    "empty",
    "list",
    "wrong-format",
    "wrong-version",
    "unknown-field",
    "zero-length",
    "negative",
    "size-not-a-number",
]
INCONSISTENT = [
    "count-mismatch",
    "past-the-end",
    "overlapping",
    "unsorted",
    "span-past-2^64",
    "compressed-span-past-2^64",
    "compressed-offset-past-2^64-after-the-first",
]
"""Manifests the schema accepts but that contradict themselves."""
NOT_OURS = ["not-json", "empty", "list", "wrong-format"]
"""Files that do not say they are a shardstream manifest: beside the shards
they are passed over with a warning (other tools write ``manifest.json``
too); named explicitly they are an error."""


def bad_manifest(case: str, a: Path) -> str:
    size = a.stat().st_size
    entry = {"url": a.name, "size": size, "samples": 1, "offsets": [0], "lengths": [512]}

    def manifest(**changes):
        shards = [dict(entry, **changes)]
        return json.dumps({"format": "shardstream.manifest", "version": 1, "shards": shards})

    texts = {
        "not-json": "{",
        "empty": "",
        "list": "[]",
        "wrong-format": json.dumps({"format": "other", "version": 1, "shards": []}),
        "wrong-version": json.dumps({"format": "shardstream.manifest", "version": 2, "shards": []}),
        "unknown-field": manifest(colour="red"),
        "zero-length": manifest(lengths=[0]),
        "negative": manifest(offsets=[-1]),
        "size-not-a-number": manifest(size="big"),
        "count-mismatch": manifest(samples=2),
        "past-the-end": manifest(offsets=[size - 100]),
        "overlapping": manifest(samples=2, offsets=[0, 256], lengths=[512, 512]),
        "unsorted": manifest(samples=2, offsets=[1024, 0], lengths=[512, 512]),
        "span-past-2^64": manifest(offsets=[2**64 - 100], lengths=[512]),
        # A compressed shard's offsets are in its decompressed tar, so they
        # may pass the shard's size, but not 2^64.
        "compressed-span-past-2^64": manifest(
            compression="gzip", offsets=[2**64 - 100], lengths=[512]
        ),
        "compressed-offset-past-2^64-after-the-first": manifest(
            compression="gzip", samples=2, offsets=[0, 2**64 - 1], lengths=[512, 2]
        ),
    }
    return texts[case]


@pytest.mark.parametrize("case", SCHEMA_INVALID + INCONSISTENT)
def test_malformed_manifest(tmp_path, case):
    a = write_sized(tmp_path / "a.tar", SIZES, "a")
    text = bad_manifest(case, a)
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        parsed = None
    if parsed is not None:
        assert MANIFEST_VALIDATOR.is_valid(parsed) == (case in INCONSISTENT)
    for path in (tmp_path / "manifest.json", tmp_path / "elsewhere.json"):
        path.write_text(text)
        if path.name == "manifest.json" and case in NOT_OURS:
            with pytest.warns(ManifestIgnoredWarning, match=re.escape(str(path))):
                ds = dataset(a)
            assert ds.manifest_path is None
            assert len(collect(ds)) == len(SIZES)
            path.unlink()
            continue
        kwargs = {} if path.name == "manifest.json" else {"manifest": path}
        with pytest.raises(ManifestError, match=re.escape(str(path))) as info:
            dataset(a, **kwargs)
        assert not isinstance(info.value, ManifestMismatchError), info.value
        if case in INCONSISTENT:
            assert a.name in str(info.value), "the message names the shard"
        path.unlink()


FOREIGN_MANIFESTS = {
    "other-format": {"format": "webdataset-index", "shards": [{"url": "a.tar", "n": 4}]},
    "no-format": {"files": ["a.tar"], "version": 3, "shards": 1},
    "list": [{"name": "a.tar"}],
    "format-not-a-string": {"format": 1, "version": 1, "shards": []},
}


@pytest.mark.parametrize("kind", list(FOREIGN_MANIFESTS))
def test_another_tools_manifest_beside_the_shards_is_passed_over(tmp_path, kind):
    """Other tools write ``manifest.json`` too: beside the shards, one that
    does not say it is a shardstream manifest is not used (a
    ``ManifestIgnoredWarning`` says so), and the data is read without one.
    Named explicitly, it is an error."""
    a = write_sized(tmp_path / "a.tar", SIZES, "a")
    b = write_sized(tmp_path / "b.tar", [10, 20], "b")
    foreign = tmp_path / "manifest.json"
    foreign.write_text(json.dumps(FOREIGN_MANIFESTS[kind]))
    with pytest.warns(ManifestIgnoredWarning) as record:
        ds = dataset(str(tmp_path), shuffle_buffer=0)
    (warning,) = [w for w in record if issubclass(w.category, ManifestIgnoredWarning)]
    assert str(foreign) in str(warning.message)
    assert "not a shardstream manifest" in str(warning.message)
    assert warning.filename == __file__, "the warning points at the caller"
    assert ds.manifest_path is None
    assert ds.shard_list.sample_counts is None
    expected = read_tar_samples(a) + read_tar_samples(b)
    assert sorted(keys_of(collect(ds))) == sorted(s.key for s in expected)
    # Not warned again when the dataset is pickled to DataLoader workers.
    with warnings.catch_warnings():
        warnings.simplefilter("error", ManifestIgnoredWarning)
        assert len(collect(loader(ds, 1))) == len(expected)
        assert dataset(str(tmp_path), manifest=False).manifest_path is None
    with pytest.raises(ManifestError, match=re.escape(str(foreign))):
        dataset(str(tmp_path), manifest=foreign)


def test_a_damaged_manifest_of_ours_beside_the_shards_is_still_an_error(tmp_path):
    """A truncated shardstream manifest names its format: it is ours and
    broken, an error rather than passed over (ranks must not plan with and
    without it by chance)."""
    a = write_sized(tmp_path / "a.tar", SIZES, "a")
    index_manifest([a], tmp_path / "manifest.json")
    text = (tmp_path / "manifest.json").read_text()
    (tmp_path / "manifest.json").write_text(text[: len(text) // 2])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ManifestIgnoredWarning)
        with pytest.raises(ManifestError, match=r"manifest\.json"):
            dataset(a)


def test_missing_explicit_manifest(tmp_path):
    a = write_sized(tmp_path / "a.tar", SIZES, "a")
    with pytest.raises(ManifestError, match=r"nope\.json"):
        dataset(a, manifest=tmp_path / "nope.json")


def test_a_directory_spec_does_not_read_the_manifest_as_a_shard(uneven_dataset):
    ds = dataset(uneven_dataset.root)
    assert [os.path.basename(u) for u, _ in ds.shards] == [p.name for p in uneven_dataset.paths]
    assert [len(shard_keys(uneven_dataset, p)) for p in uneven_dataset.paths] == list(UNEVEN_COUNTS)

"""Bad inputs: missing, non-tar, truncated, empty and duplicate-field shards,
bad specs and options; both error policies, in-process and in DataLoader
workers."""

from __future__ import annotations

import gzip
import io
import multiprocessing
import os
import re
import tarfile
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
from _shardtest import (
    assert_exactly_once,
    collect,
    keys_of,
    loader,
    member_offsets,
    read_tar_samples,
    split_member,
    tar_bytes,
    write_tar,
)

import shardstream
from shardstream import (
    DatasetSpecError,
    ShardFormatError,
    ShardNotFoundError,
    ShardSkippedWarning,
    ShardStreamError,
)

# Members of the archive the truncated shards are cut from.
INTACT = [
    ("first.wav", b"1" * 3000),
    ("first.json", b'{"n": 1}'),
    ("second.wav", b"2" * 3000),
    ("second.json", b'{"n": 2}'),
    ("third.wav", b"3" * 3000),
    ("third.json", b'{"n": 3}'),
]


@dataclass
class BadShard:
    """A bad shard on disk and what its error must say."""

    path: Path
    error: type[ShardStreamError]
    substrings: list[str]
    # Keys of the complete samples that precede the point of failure.
    complete_before_failure: list[str]


def truncated_in_data(directory: Path, member: str = "third.wav") -> BadShard:
    """``INTACT`` cut in the middle of the data of ``member``."""
    data = tar_bytes(INTACT)
    start, size = member_offsets(data)[member]
    cut = start + size // 3
    path = directory / "cut-data.tar"
    path.write_bytes(data[:cut])
    # The samples before the one the cut member belongs to are complete.
    keys = list(dict.fromkeys(split_member(name)[0] for name, _ in INTACT))
    complete = keys[: keys.index(split_member(member)[0])]
    return BadShard(path, ShardFormatError, ["truncated", member, f"byte offset {cut}"], complete)


def make_bad_shard(kind: str, directory: Path) -> BadShard:
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "missing":
        path = directory / "missing-shard.tar"
        return BadShard(path, ShardNotFoundError, [], [])
    if kind == "not_a_tar":
        path = directory / "garbage.tar"
        path.write_bytes(b"this is not a tar archive, just text\n" * 100)
        return BadShard(path, ShardFormatError, ["not a tar archive", "byte offset"], [])
    if kind == "short_garbage":
        path = directory / "short.tar"
        path.write_bytes(b"hello")
        return BadShard(path, ShardFormatError, ["not a tar archive", "byte offset"], [])
    if kind == "empty":
        path = directory / "empty.tar"
        path.write_bytes(b"")
        return BadShard(path, ShardFormatError, [], [])
    if kind == "gzipped_text":
        path = directory / "compressed.tar.gz"
        path.write_bytes(gzip.compress(b"this is not a tar archive, just text\n" * 100, mtime=0))
        return BadShard(
            path, ShardFormatError, ["not a tar archive", "of the decompressed gzip stream"], []
        )
    if kind == "truncated":
        return truncated_in_data(directory)
    if kind in ("duplicate", "duplicate_case"):
        second = "spk.1/clip-7.wav" if kind == "duplicate" else "spk.1/clip-7.WAV"
        path = write_tar(
            directory / f"{kind}.tar",
            [
                ("spk.1/before.wav", b"0"),
                ("spk.1/clip-7.wav", b"1"),
                ("spk.1/clip-7.json", b"{}"),
                (second, b"2"),
                ("spk.1/after.wav", b"3"),
            ],
        )
        return BadShard(path, ShardFormatError, ["wav", second], ["spk.1/before"])
    raise AssertionError(kind)


ALL_KINDS = [
    "missing",
    "not_a_tar",
    "short_garbage",
    "gzipped_text",
    "empty",
    "truncated",
    "duplicate",
    "duplicate_case",
]
WORKER_KINDS = ["missing", "not_a_tar", "truncated", "duplicate_case"]


def without_path(message: str, path: Path) -> str:
    """``message`` with the shard path removed, after checking it is there
    (so words in the temporary directory's name cannot satisfy a check)."""
    assert str(path) in message, f"{str(path)!r} not in {message!r}"
    return message.replace(str(path), "<shard>")


def assert_message(exc: BaseException | Warning, bad: BadShard) -> None:
    message = without_path(str(exc), bad.path)
    for part in bad.substrings:
        assert part in message, f"{part!r} not in {message!r}"


def assert_names_duplicate_key(exc: BaseException, bad: BadShard) -> None:
    # The key must appear on its own, not only as part of the member name.
    message = without_path(str(exc), bad.path)
    assert re.search(r"spk\.1/clip-7(?![\w.])", message), message
    # So must the field, lower-cased.
    assert re.search(r"(?<![\w.])wav(?![\w.])", message), message


# Kinds the dataset finds at construction with on_error="raise" and
# count_samples=True: a missing local shard, and every malformed plain tar
# (its headers are walked to count its samples). A compressed shard is not
# counted, so its damage is found when it is read.
FOUND_AT_CONSTRUCTION = set(ALL_KINDS) - {"gzipped_text"}


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_bad_local_shard_raises_at_construction(kind, tmp_path):
    bad = make_bad_shard(kind, tmp_path)
    if kind not in FOUND_AT_CONSTRUCTION:
        ds = shardstream.StreamingDataset(bad.path, count_samples=True)
        with pytest.raises(bad.error) as info:
            list(ds)
    else:
        with pytest.raises(bad.error) as info:
            shardstream.StreamingDataset(bad.path, count_samples=True)
    assert isinstance(info.value, ShardStreamError)
    assert_message(info.value, bad)
    if kind.startswith("duplicate"):
        assert_names_duplicate_key(info.value, bad)


@pytest.mark.parametrize("count_samples", [True, False])
def test_a_file_that_is_not_a_shard_is_not_quoted(tmp_path, count_samples):
    # A text file's content (a config with a secret, say) shows in no error.
    text = b"password=hunter2-topsecret-value;" * 40
    path = tmp_path / "notes.tar"
    path.write_bytes(text)
    with pytest.raises(ShardFormatError) as info:
        list(shardstream.StreamingDataset(path, count_samples=count_samples))
    message = str(info.value)
    assert "not a tar archive" in message and str(path) in message, message
    words = {text[i : i + 4].decode() for i in range(len(text) - 4)}
    assert not [w for w in words if w in message.replace(str(path), "")], message


def make_gone_after_construction(bad: BadShard, good: Path) -> None:
    """For a "missing" shard: it exists (a copy of ``good``) while the dataset
    is constructed, and is gone once :func:`remove` runs."""
    bad.path.write_bytes(good.read_bytes())


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_bad_shard_raises_at_iteration(kind, tmp_path, dataset):
    """Without counting, a malformed shard is found when it is read; a shard
    removed after construction too."""
    bad = make_bad_shard(kind, tmp_path)
    if kind == "missing":
        make_gone_after_construction(bad, dataset.paths[0])
    ds = shardstream.StreamingDataset(bad.path, count_samples=False)
    if kind == "missing":
        bad.path.unlink()
    with pytest.raises(bad.error) as info:
        list(ds)
    assert isinstance(info.value, ShardStreamError)
    assert_message(info.value, bad)
    if kind.startswith("duplicate"):
        assert_names_duplicate_key(info.value, bad)


@pytest.mark.parametrize("kind", WORKER_KINDS)
def test_bad_shard_raises_through_dataloader_workers(kind, tmp_path, dataset):
    bad = make_bad_shard(kind, tmp_path)
    if kind == "missing":
        make_gone_after_construction(bad, dataset.paths[0])
    ds = shardstream.StreamingDataset(
        [*dataset.urls[:3], str(bad.path)], seed=3, count_samples=False
    )
    if kind == "missing":
        bad.path.unlink()
    with pytest.raises(Exception) as info:
        collect(loader(ds, 2))
    # torch re-raises the worker's exception class with the original
    # traceback (and message) as its text.
    assert type(info.value).__name__ == bad.error.__name__
    assert isinstance(info.value, bad.error)
    assert_message(info.value, bad)


def test_truncated_header_is_reported_as_truncated(tmp_path):
    data = tar_bytes(INTACT)
    start, _ = member_offsets(data)["second.wav"]
    cut = start - 512 + 100  # inside the header block of second.wav
    path = tmp_path / "cut-header.tar"
    path.write_bytes(data[:cut])
    with pytest.raises(ShardFormatError) as info:
        list(shardstream.StreamingDataset(path))
    message = without_path(str(info.value), path)
    assert "truncated" in message
    assert f"byte offset {cut}" in message


@pytest.mark.parametrize("into_padding", [0, 10, "last"])
def test_truncated_padding_is_reported_as_truncated(tmp_path, into_padding):
    """Cut right after the data of a member, or inside its padding to the
    next 512-byte block: the archive is truncated, no header is bad."""
    data = tar_bytes(INTACT)
    start, size = member_offsets(data)["first.wav"]
    padding = -size % 512
    assert padding > 10, "the member must need padding"
    cut = start + size + (padding - 1 if into_padding == "last" else into_padding)
    path = tmp_path / "cut-padding.tar"
    path.write_bytes(data[:cut])
    with pytest.raises(ShardFormatError) as info:
        list(shardstream.StreamingDataset(path))
    message = without_path(str(info.value), path)
    assert f"byte offset {cut}" in message
    assert "truncated" in message, message


@pytest.mark.parametrize(
    ("after", "complete"),
    [("first.wav", []), ("second.json", ["first"]), ("third.json", ["first", "second"])],
)
def test_a_shard_cut_between_members_is_reported_as_truncated(tmp_path, after, complete):
    """Cut at the block where the member after ``after`` (or the
    end-of-archive blocks) would start, as a copy cut at a block boundary
    leaves it: nothing in the bytes is bad, but a tar archive ends with zero
    blocks, so the shard was cut short. Before, it read as a shorter
    archive: ``first`` without its ``json``, or the samples after the cut
    silently lost."""
    data = tar_bytes(INTACT)
    start, size = member_offsets(data)[after]
    cut = start + size + (-size % 512)
    path = tmp_path / "cut-between.tar"
    path.write_bytes(data[:cut])
    with pytest.raises(ShardFormatError) as info:
        list(shardstream.StreamingDataset(path))
    message = without_path(str(info.value), path)
    assert "truncated tar archive" in message and "end-of-archive" in message, message
    assert f"byte offset {cut}" in message, message
    # The sample being read when the data ended is not handed out.
    with pytest.warns(ShardSkippedWarning):
        got = keys_of(shardstream.StreamingDataset(path, shuffle_buffer=0, on_error="warn"))
    assert got == complete
    # Counting the shard's samples from its headers, when the dataset is
    # made, says the same.
    with pytest.raises(ShardFormatError, match="end-of-archive"):
        shardstream.StreamingDataset(path, count_samples=True, on_error="raise")


def test_non_utf8_member_name(tmp_path):
    data = tar_bytes([("ok.wav", b"1"), ("caf\xe9.wav", b"2")], encoding="latin-1")
    assert b"caf\xe9.wav" in data
    path = tmp_path / "latin1.tar"
    path.write_bytes(data)
    with pytest.raises(ShardFormatError) as info:
        list(shardstream.StreamingDataset(path, shuffle_buffer=0))
    message = without_path(str(info.value), path)
    assert "UTF-8" in message and "byte offset" in message


@pytest.mark.parametrize("member", ["first.json", "second.wav", "third.wav"])
def test_truncated_member_is_named(tmp_path, member):
    bad = truncated_in_data(tmp_path, member)
    with pytest.raises(ShardFormatError) as info:
        list(shardstream.StreamingDataset(bad.path))
    assert_message(info.value, bad)


@pytest.mark.parametrize("member", ["second.json", "third.wav"])
def test_raise_policy_yields_the_samples_before_the_error(tmp_path, member):
    bad = truncated_in_data(tmp_path, member)
    got = []
    with pytest.raises(ShardFormatError):
        ds = shardstream.StreamingDataset(bad.path, shuffle_buffer=0, count_samples=False)
        for sample in ds:
            got.append(sample["__key__"])
    # Only complete samples come out, in order; never a partial one.
    assert got == bad.complete_before_failure[: len(got)]


@pytest.mark.parametrize("member", ["second.json", "third.wav"])
def test_on_error_warn_keeps_complete_samples_before_a_truncation(tmp_path, member):
    """``warn`` skips the *rest* of a bad shard: the samples completely read
    before the truncated member stay, only the sample being read is dropped.
    (Cut in ``second.json``: ``second`` is incomplete. Cut in ``third.wav``:
    ``second`` was read in full before ``third`` began.)"""
    bad = truncated_in_data(tmp_path, member)
    with pytest.warns(ShardSkippedWarning):
        got = keys_of(shardstream.StreamingDataset(bad.path, shuffle_buffer=0, on_error="warn"))
    assert got == bad.complete_before_failure


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_on_error_warn_skips_a_bad_shard(kind, tmp_path, dataset):
    bad = make_bad_shard(kind, tmp_path)
    good_urls = dataset.urls[:4]
    ds = shardstream.StreamingDataset([*good_urls, str(bad.path)], seed=1, on_error="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = keys_of(ds)
    skipped = [w for w in caught if issubclass(w.category, ShardSkippedWarning)]
    assert len(skipped) == 1, [str(w.message) for w in caught]
    assert_message(skipped[0].message, bad)
    good = dataset.keys_of(good_urls)
    extra = [k for k in got if k not in set(good)]
    assert_exactly_once([k for k in got if k in set(good)], good)
    assert len(set(extra)) == len(extra)
    assert set(extra) <= set(bad.complete_before_failure)
    stats = ds.stats()
    assert stats["errors_skipped"] == 1
    assert stats["shards_completed"] == len(good_urls)
    assert stats["samples"] == len(got)


def test_on_error_warn_several_bad_shards(tmp_path, dataset):
    bads = [make_bad_shard(k, tmp_path / k) for k in ("missing", "empty", "duplicate")]
    urls = [dataset.urls[0], str(bads[0].path), dataset.urls[1], *(str(b.path) for b in bads[1:])]
    ds = shardstream.StreamingDataset(urls, on_error="warn", shuffle_shards=False)
    with pytest.warns(ShardSkippedWarning) as record:
        got = keys_of(ds)
    messages = [str(w.message) for w in record if issubclass(w.category, ShardSkippedWarning)]
    assert len(messages) == len(bads)
    for bad in bads:
        assert sum(str(bad.path) in m for m in messages) == 1
    good = dataset.keys_of(dataset.urls[:2])
    assert [k for k in got if k in set(good)] != []
    assert_exactly_once([k for k in got if k in set(good)], good)
    assert ds.stats()["errors_skipped"] == len(bads)


@pytest.mark.parametrize("kind", WORKER_KINDS)
def test_on_error_warn_through_dataloader_workers(kind, tmp_path, dataset):
    bad = make_bad_shard(kind, tmp_path)
    good_urls = dataset.urls[:5]
    ds = shardstream.StreamingDataset([*good_urls, str(bad.path)], seed=2, on_error="warn")
    got = keys_of(loader(ds, 2, multiprocessing_context="fork"))
    good = dataset.keys_of(good_urls)
    assert_exactly_once([k for k in got if k in set(good)], good)
    assert set(got) - set(good) <= set(bad.complete_before_failure)
    # Workers' warnings stay in the workers, but the shared counters see them.
    assert ds.stats()["errors_skipped"] == 1
    assert ds.stats()["shards_completed"] == len(good_urls)


def test_warning_category_under_error_filter(tmp_path, dataset):
    """A ``ShardSkippedWarning`` turned into an error by the warnings filter
    surfaces as that exception."""
    bad = make_bad_shard("missing", tmp_path)
    ds = shardstream.StreamingDataset([dataset.urls[0], str(bad.path)], on_error="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardSkippedWarning)
        with pytest.raises(ShardSkippedWarning, match=re.escape(str(bad.path))):
            list(ds)


# --------------------------------------------------------------------------
# Specs and options.
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", ["{1..", "shard-{000..", "x}", "{5..1}", "{a..b}", "{x}", "{{1..2}}", "a{1..2}}"]
)
def test_bad_spec_raises_at_construction(spec, tmp_path):
    with pytest.raises(DatasetSpecError) as info:
        shardstream.StreamingDataset(f"{tmp_path}/{spec}")
    assert isinstance(info.value, ShardStreamError)
    assert spec in str(info.value)


def test_empty_directory_is_a_spec_error(tmp_path):
    (tmp_path / "readme.txt").write_text("no shards here")
    with pytest.raises(DatasetSpecError):
        shardstream.StreamingDataset(tmp_path)


def test_empty_list_is_a_spec_error():
    with pytest.raises(DatasetSpecError):
        shardstream.StreamingDataset([])


def test_shard_listed_twice_is_a_spec_error(dataset):
    with pytest.raises(DatasetSpecError, match=re.escape(dataset.urls[0])):
        shardstream.StreamingDataset([dataset.urls[0], dataset.urls[1], dataset.urls[0]])


def test_bad_on_error_is_value_error(dataset):
    with pytest.raises(ValueError, match="bogus"):
        shardstream.StreamingDataset(dataset.spec, on_error="bogus")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "option",
    [
        {"io_timeout": 0.0},
        {"read_ahead_bytes": 0},
        {"shuffle_buffer_bytes": 0},
        {"shuffle_initial": 0},
    ],
)
def test_invalid_numeric_options_are_value_errors(dataset, option):
    name = next(iter(option))
    with pytest.raises(ValueError, match=name):
        list(shardstream.StreamingDataset(dataset.spec, **option))


def test_missing_local_shard_raises_at_construction(tmp_path, dataset):
    missing = tmp_path / "gone.tar"
    with pytest.raises(ShardNotFoundError, match=re.escape(str(missing))):
        shardstream.StreamingDataset([dataset.urls[0], str(missing)], count_samples=False)


def test_missing_shard_raises_after_good_shards_in_order(tmp_path, dataset):
    gone = tmp_path / "gone.tar"
    gone.write_bytes(dataset.paths[1].read_bytes())
    ds = shardstream.StreamingDataset(
        [dataset.urls[0], str(gone)], shuffle_shards=False, shuffle_buffer=0
    )
    gone.unlink()
    got = []
    with pytest.raises(ShardNotFoundError, match=re.escape(str(gone))):
        for sample in ds:
            got.append(sample["__key__"])
    assert got == dataset.keys_of([dataset.urls[0]])


def test_error_does_not_poison_the_next_epoch(tmp_path, dataset):
    path = tmp_path / "later.tar"
    path.write_bytes(dataset.paths[1].read_bytes())
    ds = shardstream.StreamingDataset([dataset.urls[0], str(path)])
    path.unlink()
    with pytest.raises(ShardNotFoundError):
        list(ds)
    path.write_bytes(dataset.paths[1].read_bytes())
    ds.set_epoch(1)
    expected = dataset.keys_of(dataset.urls[:2])
    assert_exactly_once(keys_of(ds), expected)
    assert read_tar_samples(path)  # the copy is a valid shard


def _stream_and_cut(
    results: Connection,
    path: str,
    cut: int,
    after: int,
    size: int,
    shuffle: int,
    read_ahead: int,
    packed: bool = False,
) -> None:
    """Streams ``path`` and cuts it short (``os.truncate``) once ``after``
    samples are in; sends how many samples were intact, how many were not,
    and the error. ``packed``: in batches of 4 with ``pack_bytes``, each
    member cut out of its batch's buffer."""
    dataset = shardstream.StreamingDataset(
        path,
        shuffle_buffer=shuffle,
        read_ahead_bytes=read_ahead,
        batch_size=4 if packed else None,
        pack_bytes=packed,
    )
    intact, altered, outcome = 0, 0, {"error": None, "message": ""}
    try:
        for sample in _unpacked(dataset) if packed else dataset:
            index = int(sample["__key__"][1:])
            if sample["bin"] == bytes([index % 251 + 1]) * size:
                intact += 1
            else:
                altered += 1
            if intact + altered == after:
                os.truncate(path, cut)
    except ShardStreamError as error:
        outcome = {"error": type(error).__name__, "message": str(error)}
    results.send({"intact": intact, "altered": altered, **outcome})


def _unpacked(batches: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The samples of ``pack_bytes`` batches of one ``bin`` field."""
    for batch in batches:
        data, offsets = batch["bin"], batch["bin_offsets"]
        for i, key in enumerate(batch["__key__"]):
            yield {"__key__": key, "bin": data[offsets[i] : offsets[i + 1]].tobytes()}


def stream_and_cut(path: Path, **kwargs: Any) -> dict[str, Any]:
    """``_stream_and_cut`` in a forked child, so that a SIGBUS there cannot
    end the test run: the child must exit normally."""
    context = multiprocessing.get_context("fork")
    results, sender = context.Pipe(duplex=False)
    child = context.Process(target=_stream_and_cut, args=(sender, str(path)), kwargs=kwargs)
    child.start()
    sender.close()
    try:
        outcome = results.recv() if results.poll(120) else None
    except EOFError:
        outcome = None
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0, f"the stream died (exit code {child.exitcode})"
    assert outcome is not None, "the stream sent no outcome"
    return outcome


def write_filled_shard(path: Path, count: int, size: int) -> Path:
    """``count`` samples ``sNNNN.bin`` of ``size`` bytes, each one byte
    (never zero) repeated, written member by member."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for index in range(count):
            info = tarfile.TarInfo(f"s{index:04d}.bin")
            info.size = size
            tar.addfile(info, io.BytesIO(bytes([index % 251 + 1]) * size))
    return path


@pytest.mark.parametrize(("shuffle", "packed"), [(0, False), (32, False), (0, True)])
def test_a_shard_cut_short_while_mapped_is_a_read_error_not_a_crash(tmp_path, shuffle, packed):
    # 1 MB members of a 72 MB shard: read from mapped chunks, handed out as
    # views of them; many are mapped, parsed and queued when the shard is
    # cut to 16 MiB.
    size, count, cut = 1_000_000, 72, 16 << 20
    path = write_filled_shard(tmp_path / "big.tar", count, size)
    outcome = stream_and_cut(
        path, cut=cut, after=5, size=size, shuffle=shuffle, read_ahead=32 << 20, packed=packed
    )
    assert outcome["altered"] == 0, "a sample held bytes that were not in the file"
    assert outcome["error"] == "ShardReadError", outcome
    # Cut short under a mapping, or found shorter before the next chunk is
    # mapped, if the reader had not got that far.
    lost = r"big\.tar: read failed at byte offset (\d+): the file (was cut short|shrank)"
    match = re.search(lost, outcome["message"])
    assert match, outcome["message"]
    assert cut <= int(match.group(1)) < count * (size + 1024), outcome["message"]
    # Members copied out before the cut (those across two chunks) are intact
    # past it too; the views of the lost pages are not handed out.
    assert 5 <= outcome["intact"] < count, outcome


def test_a_shard_that_shrinks_ahead_of_the_reader_is_a_read_error_naming_the_offset(tmp_path):
    # 4 KB members, one 1 MiB chunk read ahead: the chunks past the first
    # few are mapped after the shard is cut to 8 MiB.
    size, count, cut = 4000, 4000, 8 << 20
    path = write_filled_shard(tmp_path / "shrinks.tar", count, size)
    outcome = stream_and_cut(path, cut=cut, after=5, size=size, shuffle=0, read_ahead=1 << 20)
    assert outcome["altered"] == 0, "a sample held bytes that were not in the file"
    assert outcome["error"] == "ShardReadError", outcome
    assert re.match(
        rf".*shrinks\.tar: read failed at byte offset {cut}: the file shrank while it was read: "
        rf"it has {cut} bytes now, \d+ when it was opened",
        outcome["message"],
    ), outcome["message"]
    # Every sample that lies wholly before the cut, and none after it.
    member = 512 + size + (-size % 512)
    assert outcome["intact"] == cut // member, outcome

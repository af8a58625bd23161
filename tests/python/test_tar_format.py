"""How tar members become samples (the WebDataset rule), through the Python API.

Every case builds a tar with Python's ``tarfile`` and compares shardstream's
samples with the grouping computed independently by ``read_tar_samples``.
"""

from __future__ import annotations

import io
import tarfile

import pytest
from _shardtest import read_tar_samples, regular, retype, special, tar_bytes

import shardstream


def stream(path, **kwargs):
    """Samples in file order (no shuffling), as ``(key, {field: bytes})``."""
    ds = shardstream.StreamingDataset(path, shuffle_shards=False, shuffle_buffer=0, **kwargs)
    out = []
    for sample in ds:
        assert sample["__url__"] == str(path)
        out.append((sample["__key__"], {k: v for k, v in sample.items() if not k.startswith("__")}))
    return out


def expected(path):
    return [(s.key, s.fields) for s in read_tar_samples(path)]


def check(path, want):
    """shardstream, the independent reader and the literal expectation agree."""
    got = stream(path)
    assert got == expected(path)
    assert got == want
    return got


def test_consecutive_members_form_one_sample(tar_factory):
    path = tar_factory(
        "basic.tar",
        [("a.wav", b"A1"), ("a.json", b"{}"), ("a.txt", b"t"), ("b.wav", b"B1"), ("b.cls", b"3")],
    )
    got = check(
        path,
        [
            ("a", {"wav": b"A1", "json": b"{}", "txt": b"t"}),
            ("b", {"wav": b"B1", "cls": b"3"}),
        ],
    )
    # Fields keep member order.
    assert list(got[0][1]) == ["wav", "json", "txt"]


def test_dotted_directories(tar_factory):
    path = tar_factory(
        "dotted.tar",
        [("a.b/c.jpg", b"1"), ("a.b/c.txt", b"2"), ("x.y.z/w/d.e.f", b"3")],
    )
    check(path, [("a.b/c", {"jpg": b"1", "txt": b"2"}), ("x.y.z/w/d", {"e.f": b"3"})])


def test_extension_is_lower_cased(tar_factory):
    path = tar_factory("upper.tar", [("Clip.WAV", b"1"), ("Clip.Json", b"2"), ("DIR/Q.JPG", b"3")])
    # The key keeps its case; the field is lower-cased.
    check(path, [("Clip", {"wav": b"1", "json": b"2"}), ("DIR/Q", {"jpg": b"3"})])


def test_multi_dot_fields(tar_factory):
    path = tar_factory(
        "multidot.tar",
        [("x.seg.json", b"1"), ("x.seg.wav", b"2"), ("x.json", b"3"), ("y.tar.gz", b"4")],
    )
    check(path, [("x", {"seg.json": b"1", "seg.wav": b"2", "json": b"3"}), ("y", {"tar.gz": b"4"})])


def test_members_without_a_dot_are_skipped(tar_factory):
    path = tar_factory(
        "nodot.tar",
        [
            ("README", b"docs"),
            ("a.wav", b"1"),
            ("dir.v2/LICENSE", b"l"),
            ("a.json", b"2"),
            ("d/.hidden", b"h"),
            ("b.wav", b"3"),
        ],
    )
    # Skipped members do not break a sample apart.
    check(path, [("a", {"wav": b"1", "json": b"2"}), ("b", {"wav": b"3"})])


def test_directory_entries_are_skipped(tar_factory):
    path = tar_factory(
        "dirs.tar",
        [
            special("data.v1", tarfile.DIRTYPE),
            special("data.v1/a.wav", tarfile.DIRTYPE),  # a directory that looks like a field
            ("data.v1/a.json", b"1"),
            special("data.v1/sub", tarfile.DIRTYPE),
            ("data.v1/a.txt", b"2"),
        ],
    )
    check(path, [("data.v1/a", {"json": b"1", "txt": b"2"})])


@pytest.mark.parametrize("typeflag", [tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.CHRTYPE])
def test_entry_type_decides_not_the_name(tmp_path, typeflag):
    """A non-regular entry named like a field (no trailing slash) is skipped."""
    data = tar_bytes([("a.wav", b"1"), ("a.flac", b""), ("a.json", b"2"), ("b.flac", b"")])
    data = retype(retype(data, "a.flac", typeflag), "b.flac", typeflag)
    path = tmp_path / "retyped.tar"
    path.write_bytes(data)
    with tarfile.open(path) as tar:
        assert [m.type for m in tar if m.name.endswith(".flac")] == [typeflag, typeflag]
    check(path, [("a", {"wav": b"1", "json": b"2"})])


@pytest.mark.parametrize(
    ("kind", "linkname"),
    [(tarfile.SYMTYPE, "a.wav"), (tarfile.LNKTYPE, "a.wav"), (tarfile.FIFOTYPE, "")],
)
def test_non_regular_entries_are_skipped(tar_factory, kind, linkname):
    path = tar_factory(
        "links.tar",
        [
            ("a.wav", b"1"),
            special("a.flac", kind, linkname),
            ("a.json", b"2"),
            special("z.wav", kind, linkname),
        ],
    )
    check(path, [("a", {"wav": b"1", "json": b"2"})])


def test_only_skipped_members_gives_no_samples(tar_factory):
    path = tar_factory(
        "nothing.tar", [special("d.x", tarfile.DIRTYPE), ("README", b"x"), ("NOTES", b"y")]
    )
    assert stream(path) == []
    assert expected(path) == []


def test_empty_archive_gives_no_samples(tar_factory):
    path = tar_factory("empty-archive.tar", [])
    assert path.stat().st_size > 0  # end-of-archive blocks only
    assert stream(path) == []


LONG_DIR = "/".join([f"very-long-directory-name-{i:02d}.d" for i in range(6)])


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT], ids=["gnu", "pax"])
def test_long_names(tar_factory, fmt):
    stem = "s" * 120
    name = f"{LONG_DIR}/{stem}"
    assert len(name) > 200
    members = [(f"{name}.WAV", b"long1"), (f"{name}.json", b"long2"), ("short.wav", b"x")]
    path = tar_factory("long.tar", members, format=fmt)
    # The archive really uses the format's long-name mechanism.
    raw = path.read_bytes()
    if fmt == tarfile.GNU_FORMAT:
        assert b"././@LongLink" in raw
    else:
        assert b"path=" in raw
    check(path, [(name, {"wav": b"long1", "json": b"long2"}), ("short", {"wav": b"x"})])


def test_ustar_prefix_names(tar_factory):
    name = f"{LONG_DIR[:120]}/clip"  # fits the 155-byte prefix + 100-byte name
    assert len(name) > 100
    path = tar_factory("ustar.tar", [(f"{name}.wav", b"u")], format=tarfile.USTAR_FORMAT)
    check(path, [(name, {"wav": b"u"})])


def test_pax_non_ascii_names_and_global_header(tar_factory):
    members = [("données/é-1.wav", b"1"), ("données/é-1.txt", "é".encode()), ("日本.json", b"{}")]
    path = tar_factory(
        "pax.tar", members, format=tarfile.PAX_FORMAT, pax_headers={"comment": "global"}
    )
    check(
        path,
        [("données/é-1", {"wav": b"1", "txt": "é".encode()}), ("日本", {"json": b"{}"})],
    )


def test_non_consecutive_repeats_give_two_samples(tar_factory):
    path = tar_factory(
        "repeat.tar", [("a.wav", b"1"), ("b.wav", b"2"), ("a.wav", b"3"), ("a.json", b"4")]
    )
    check(path, [("a", {"wav": b"1"}), ("b", {"wav": b"2"}), ("a", {"wav": b"3", "json": b"4"})])


def test_same_stem_in_different_directories_are_different_keys(tar_factory):
    path = tar_factory("dirs2.tar", [("x/a.wav", b"1"), ("y/a.wav", b"2"), ("a.wav", b"3")])
    check(path, [("x/a", {"wav": b"1"}), ("y/a", {"wav": b"2"}), ("a", {"wav": b"3"})])


def test_empty_and_large_members(tar_factory):
    big = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MiB: spans several read chunks
    path = tar_factory("sizes.tar", [("e.txt", b""), ("e.bin", big), ("f.txt", b"z" * 511)])
    check(path, [("e", {"txt": b"", "bin": big}), ("f", {"txt": b"z" * 511})])
    # The same with a read-ahead budget far below one member.
    got = stream(path, read_ahead_bytes=1000)
    assert got == expected(path)


def test_member_with_modes_and_owners(tmp_path):
    info = regular("owned.wav", 3)
    info.uid, info.gid, info.uname, info.gname, info.mode = 1000, 1000, "u", "g", 0o600
    path = tmp_path / "owned.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(b"abc"))
    check(path, [("owned", {"wav": b"abc"})])


def test_generated_shard_matches_tarfile(dataset):
    for path in dataset.paths[:2]:
        got = stream(path)
        assert got == expected(path)
        assert [key for key, _ in got] == dataset.keys_of([str(path)])


# --------------------------------------------------------------------------
# Damaged headers and what follows the end of the archive
# --------------------------------------------------------------------------


def with_header(data: bytes, offset: int, patch) -> bytes:
    """``data`` with the header at ``offset`` changed by ``patch`` (a function
    of a ``bytearray``) and its checksum fixed."""
    header = bytearray(data[offset : offset + 512])
    patch(header)
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return data[:offset] + bytes(header) + data[offset + 512 :]


THREE = [("a.x", b"1" * 700), ("b.x", b"hello"), ("c.x", b"3")]


def header_offset(data: bytes, name: str) -> int:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        return tar.getmember(name).offset


def test_a_base_256_size_of_2_to_the_64_or_more_is_an_error(tmp_path):
    """GNU base-256 size fields are 12 bytes: a value that needs more than
    64 bits is refused, not read modulo 2^64 (here 2^64 + 5 would read 5)."""
    data = tar_bytes(THREE)
    at = header_offset(data, "b.x")

    def huge(header: bytearray) -> None:
        header[124:136] = bytes([0x80, 0, 0, 1]) + (5).to_bytes(8, "big")

    path = tmp_path / "huge-size.tar"
    path.write_bytes(with_header(data, at, huge))
    with pytest.raises(shardstream.ShardFormatError) as info:
        stream(path)
    message = str(info.value)
    assert "size is a base-256 number of 2^64 or more" in message, message
    assert f"at byte offset {at}" in message and str(path) in message, message


@pytest.mark.parametrize("wiped", ["a.x", "b.x"])
def test_a_zeroed_header_followed_by_members_is_an_error(tmp_path, wiped):
    """A zero block where a header should be, with members after it: not
    the end of the archive (which formerly gave fewer samples, or none, and
    counted the shard completed) but an error naming the block."""
    data = tar_bytes(THREE)
    at = header_offset(data, wiped)
    path = tmp_path / "wiped.tar"
    path.write_bytes(data[:at] + bytes(512) + data[at + 512 :])
    with pytest.raises(shardstream.ShardFormatError) as info:
        stream(path)
    message = str(info.value)
    assert "a zero block ends the archive here, but non-zero data follows" in message
    assert f"at byte offset {at}" in message and str(path) in message, message
    ds = shardstream.StreamingDataset(path, shuffle_buffer=0, on_error="warn")
    with pytest.warns(shardstream.ShardSkippedWarning, match="zero block"):
        assert list(ds) == []
    stats = ds.stats()
    assert (stats["shards_completed"], stats["errors_skipped"]) == (0, 1)


def test_only_zeros_may_follow_the_end_of_archive(tmp_path):
    data = tar_bytes(THREE)
    want = [("a", {"x": b"1" * 700}), ("b", {"x": b"hello"}), ("c", {"x": b"3"})]
    padded = tmp_path / "padded.tar"
    padded.write_bytes(data + bytes(100_000))
    assert stream(padded) == want
    junk = tmp_path / "junk.tar"
    junk.write_bytes(data + b"\0" * 700 + b"junk")
    with pytest.raises(shardstream.ShardFormatError) as info:
        stream(junk)
    assert f"non-zero data follows at byte offset {len(data) + 700}" in str(info.value)

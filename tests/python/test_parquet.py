"""Parquet files, local and on S3: rows compared with what pyarrow reads from
the same files (nulls, nested, dictionary-encoded columns, several codecs),
row groups split across DataLoader workers and ranks exactly once, column
projection, Arrow record batches, and clear errors for corrupt files."""

from __future__ import annotations

import base64
import re
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _shardtest import collect, loader, shardstream_cli
from s3_server import s3_config as config

import shardstream
from shardstream import StreamingDataset


def as_is(item):
    """DataLoader's per-item hook that keeps items as they are (the default
    turns tuples into lists and numpy arrays into tensors)."""
    return item


CODECS = ["snappy", "zstd", "gzip", "lz4", "brotli", "none"]
ROWS = 240
ROW_GROUP = 50


def table(rows: int, seed: int) -> pa.Table:
    """Columns of every kind the per-row output supports, with nulls."""
    ids = list(range(seed * 10_000, seed * 10_000 + rows))
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "small": pa.array([i % 7 - 3 if i % 5 else None for i in ids], pa.int8()),
            "big": pa.array([2**64 - 1 - i for i in ids], pa.uint64()),
            "score": pa.array([i / 3 if i % 4 else None for i in ids], pa.float64()),
            "half": pa.array([float(i % 9) for i in ids], pa.float32()),
            "flag": pa.array([i % 3 == 0 for i in ids], pa.bool_()),
            "text": pa.array([f"row {i} é" if i % 6 else None for i in ids], pa.string()),
            "blob": pa.array([bytes([i % 256]) * (i % 5) for i in ids], pa.binary()),
            "label": pa.array([["cat", "dog", "emu"][i % 3] for i in ids]).dictionary_encode(),
            "tags": pa.array(
                [[f"t{j}" for j in range(i % 4)] if i % 11 else None for i in ids],
                pa.list_(pa.string()),
            ),
            "point": pa.array(
                [{"x": i, "y": None if i % 2 else float(i)} for i in ids],
                pa.struct([("x", pa.int32()), ("y", pa.float64())]),
            ),
            "attrs": pa.array(
                [[("k", i), ("j", -i)] if i % 3 else [] for i in ids],
                pa.map_(pa.string(), pa.int64()),
            ),
            "nested": pa.array(
                [[{"a": [i, None]}] for i in ids],
                pa.list_(pa.struct([("a", pa.list_(pa.int64()))])),
            ),
        }
    )


def write_files(root: Path, codecs: list[str]) -> dict[str, pa.Table]:
    """One file per codec, several row groups each, dictionary encoding on."""
    root.mkdir(parents=True, exist_ok=True)
    written = {}
    for n, codec in enumerate(codecs):
        path = root / f"part-{n:02d}-{codec}.parquet"
        data = table(ROWS, n)
        pq.write_table(data, path, compression=codec, row_group_size=ROW_GROUP, use_dictionary=True)
        written[str(path)] = data
    return written


def expected_rows(files: dict[str, pa.Table]) -> dict[tuple[str, str], dict]:
    """``{(url, key): row}`` as pyarrow reads the files back."""
    rows = {}
    for url in files:
        for i, row in enumerate(pq.read_table(url).to_pylist()):
            rows[(url, str(i))] = row
    return rows


def row_of(sample: dict) -> dict:
    return {k: v for k, v in sample.items() if not k.startswith("__")}


@pytest.fixture(scope="module")
def parquet_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pa.Table]:
    return write_files(tmp_path_factory.mktemp("parquet"), CODECS)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_rows_equal_what_pyarrow_reads(parquet_files, num_workers):
    root = str(Path(next(iter(parquet_files))).parent)
    ds = StreamingDataset(root, shuffle_buffer=64, seed=3)
    # Each row group is a shard of the plan, with its row count known.
    groups = -(-ROWS // ROW_GROUP)
    assert ds.shard_list.kinds == ["parquet"] * (groups * len(CODECS))
    assert len(ds) == ROWS * len(CODECS)
    samples = collect(loader(ds, num_workers, collate_fn=as_is))
    expected = expected_rows(parquet_files)
    got = Counter((s["__url__"], s["__key__"]) for s in samples)
    assert got == Counter(expected.keys())
    for sample in samples:
        assert row_of(sample) == expected[(sample["__url__"], sample["__key__"])]
    # Each row group's column chunks are fetched once, except a row group
    # that the equal cut splits between the two workers: both fetch it.
    spans = [size for _, size in ds.shards]
    fetched = ds.stats()["bytes_read"]
    if num_workers == 0:
        assert fetched == sum(spans)
    else:
        assert sum(spans) <= fetched <= sum(spans) + max(spans)


def test_one_file_split_across_ranks_and_workers_exactly_once(tmp_path):
    files = write_files(tmp_path, ["zstd"])
    (url,) = files
    seen: list[str] = []
    per_rank = []
    for rank in range(3):
        ds = StreamingDataset(url, rank=rank, world_size=3, seed=9, shuffle_buffer=10)
        keys = [s["__key__"] for s in collect(loader(ds, 2, collate_fn=as_is))]
        per_rank.append(len(keys))
        assert len(keys) == len(ds)
        seen += keys
    # Equal length per rank (drop policy), every kept row once.
    assert per_rank == [ROWS // 3] * 3
    assert len(seen) == len(set(seen)) == ROWS // 3 * 3
    # `shardstream plan` names each piece's row group.
    groups = pq.ParquetFile(url).num_row_groups
    assert groups > 1
    plan = shardstream_cli("plan", url, "--world-size", "3", "--workers", "2", "--seed", "9")
    assert plan.returncode == 0, plan.stderr
    named = {int(n) for n in re.findall(r"row group (\d+) samples", plan.stdout)}
    assert named == set(range(groups)), plan.stdout


def test_column_projection(parquet_files):
    url = next(iter(parquet_files))
    ds = StreamingDataset(url, columns=["text", "id"], shuffle_buffer=0, shuffle_shards=False)
    samples = collect(ds)
    assert [row_of(s) for s in samples] == pq.read_table(url, columns=["text", "id"]).to_pylist()
    with pytest.raises(shardstream.ShardFormatError, match="nope"):
        collect(StreamingDataset(url, columns=["nope"], shuffle_buffer=0))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_arrow_batches_are_zero_copy_record_batches(parquet_files, num_workers):
    urls = sorted(parquet_files)[:2]
    ds = StreamingDataset(
        urls, batch_format="arrow", batch_size=32, shuffle_buffer=0, columns=["id", "tags"]
    )
    batches = collect(loader(ds, num_workers, collate_fn=as_is))
    assert all(isinstance(b, pa.RecordBatch) for b in batches)
    assert all(b.num_rows <= 32 for b in batches)
    assert all(b.schema.names == ["id", "tags"] for b in batches)
    got = pa.Table.from_batches(batches).sort_by("id")
    want = pa.concat_tables([pq.read_table(u, columns=["id", "tags"]) for u in urls])
    assert got.equals(want.sort_by("id"))
    with pytest.raises(ValueError, match="shuffle_buffer"):
        collect(StreamingDataset(urls, batch_format="arrow"))


def test_exact_resume_mid_row_group(tmp_path):
    files = write_files(tmp_path, ["snappy"])
    url = next(iter(files))
    full = [s["__key__"] for s in collect(StreamingDataset(url, seed=5, shuffle_buffer=16))]
    ds = StreamingDataset(url, seed=5, shuffle_buffer=16)
    it = iter(ds)
    head = [next(it)["__key__"] for _ in range(37)]
    state = ds.state_dict()
    del it
    resumed = StreamingDataset(url, seed=5, shuffle_buffer=16)
    resumed.load_state_dict(state)
    tail = [s["__key__"] for s in collect(resumed)]
    assert head + tail == full


def test_corrupt_files_raise_naming_the_file(tmp_path):
    good = tmp_path / "good.parquet"
    pq.write_table(table(ROWS, 0), good, row_group_size=ROW_GROUP, compression="zstd")
    data = good.read_bytes()

    not_parquet = tmp_path / "text.parquet"
    not_parquet.write_bytes(b"this is not a parquet file at all, just text" * 10)
    with pytest.raises(shardstream.ShardFormatError, match=r"text\.parquet.*byte offset"):
        StreamingDataset(str(not_parquet))

    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(data[: len(data) - 100])
    with pytest.raises(shardstream.ShardFormatError, match=r"truncated\.parquet"):
        StreamingDataset(str(truncated))

    # Garbage inside the column chunks: the footer is fine, the pages are not.
    garbled = tmp_path / "garbled.parquet"
    middle = bytearray(data)
    for i in range(8, len(data) // 2):
        middle[i] = 0xAB
    garbled.write_bytes(bytes(middle))
    ds = StreamingDataset(str(garbled), shuffle_buffer=0)
    with pytest.raises(shardstream.ShardFormatError, match=r"garbled\.parquet.*row group"):
        collect(loader(ds, 2, collate_fn=as_is))

    # Under on_error="warn" the bad row groups are skipped and counted.
    ds = StreamingDataset(str(garbled), shuffle_buffer=0, on_error="warn")
    with pytest.warns(shardstream.ShardSkippedWarning):
        kept = collect(ds)
    assert ds.stats()["errors_skipped"] >= 1
    assert len(kept) < ROWS


def test_parquet_on_s3(s3, s3_credentials, tmp_path):
    files = write_files(tmp_path, ["snappy", "gzip"])
    client = s3.client()
    client.create_bucket(Bucket="tables")
    urls = {}
    for path in files:
        key = f"tables/{Path(path).name}"
        client.upload_file(path, "tables", key)
        urls[f"s3://tables/{key}"] = path
    ds = StreamingDataset("s3://tables/tables/", s3=config(s3), shuffle_buffer=8)
    samples = collect(loader(ds, 2, collate_fn=as_is))
    expected = expected_rows(files)
    assert len(samples) == len(expected)
    for sample in samples:
        local = urls[sample["__url__"]]
        assert row_of(sample) == expected[(local, sample["__key__"])]
    assert ds.stats()["bytes_read"] == sum(size for _, size in ds.shards)


def test_decoders_on_typed_and_binary_columns(tmp_path):
    import io

    import numpy as np
    from PIL import Image

    images = [np.full((2, 3, 3), i, np.uint8) for i in range(4)]
    pngs = []
    for image in images:
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, "PNG")
        pngs.append(buf.getvalue())
    path = tmp_path / "images.parquet"
    pq.write_table(
        pa.table(
            {
                "png": pa.array([*pngs[:3], None], pa.binary()),
                "meta": pa.array([f'{{"i": {i}}}' for i in range(4)], pa.string()),
                "txt": pa.array(["a", "b", None, "d"], pa.string()),
                "cls": pa.array([1, 2, 3, 4], pa.int64()),
            }
        ),
        path,
    )
    # Defaults decode the binary png column and leave typed columns (a
    # string txt, an int cls) and nulls as they are.
    ds = StreamingDataset(str(path), decode=True, shuffle_buffer=0, shuffle_shards=False)
    rows = collect(ds)
    for i, row in enumerate(rows[:3]):
        np.testing.assert_array_equal(row["png"], images[i])
    assert rows[3]["png"] is None
    assert [r["txt"] for r in rows] == ["a", "b", None, "d"]
    assert [r["cls"] for r in rows] == [1, 2, 3, 4]
    # A decoder named for a text column reads its text.
    ds = StreamingDataset(str(path), decode={"meta": "json"}, shuffle_buffer=0)
    assert sorted(r["meta"]["i"] for r in collect(ds)) == [0, 1, 2, 3]
    with pytest.raises(shardstream.FieldDecodeError, match=r"field \"cls\".*neither bytes"):
        collect(StreamingDataset(str(path), decode={"cls": "int"}, shuffle_buffer=0))


def test_page_checksums_are_verified(tmp_path):
    """A file written with page CRC-32s and one bit flipped in a data page:
    pyarrow rejects it when asked to verify, and so does shardstream,
    always, naming the file and the row group; before, the changed value
    was yielded."""
    ids = [0x5EED_0000_0000 + i * 0x0101_0101 for i in range(100)]
    data = pa.table({"id": pa.array(ids, pa.int64()), "text": [f"row {i}" for i in ids]})
    path = tmp_path / "checksummed.parquet"
    pq.write_table(
        data,
        path,
        write_page_checksum=True,
        compression="none",
        use_dictionary=False,
        row_group_size=50,
    )

    def rows(**kwargs):
        ds = StreamingDataset(path, shuffle_shards=False, shuffle_buffer=0, **kwargs)
        return collect(ds), ds

    assert [row["id"] for row in rows()[0]] == ids
    intact = path.read_bytes()
    needle = ids[60].to_bytes(8, "little")  # in row group 1, stored as it is
    assert intact.count(needle) == 1
    damaged = bytearray(intact)
    damaged[intact.index(needle) + 3] ^= 0x04
    path.write_bytes(damaged)
    assert pq.read_table(path)["id"][60].as_py() != ids[60]
    with pytest.raises(OSError, match="CRC"):
        pq.read_table(path, page_checksum_verification=True)

    with pytest.raises(shardstream.ShardFormatError) as info:
        rows()
    message = str(info.value)
    assert str(path) in message and "row group 1: " in message, message
    assert "CRC checksum mismatch" in message and "byte offset" in message, message
    with pytest.warns(shardstream.ShardSkippedWarning, match="row group 1"):
        kept, ds = rows(on_error="warn")
    assert [row["id"] for row in kept] == ids[:50]
    assert ds.stats()["errors_skipped"] == 1


def varint(n: int) -> bytes:
    """``n`` (not negative) as a ULEB128 varint, as Thrift's compact protocol writes it."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def thrift_i64(field_delta: int, value: int) -> bytes:
    """A compact-protocol i64 field (type 6) ``field_delta`` ids after the one before."""
    return bytes([field_delta << 4 | 6]) + varint(value << 1 if value >= 0 else ~value << 1 | 1)


def with_dictionary_page_offset_zero(path: Path) -> None:
    """Rewrites the footer of the Parquet file at ``path`` (one column with a
    dictionary page, one row group) as parquet-mr wrote some: the column
    chunk's ``data_page_offset`` at its first page, the dictionary page,
    and ``dictionary_page_offset`` 0."""
    data = path.read_bytes()
    column = pq.ParquetFile(path).metadata.row_group(0).column(0)
    dictionary, first_data = column.dictionary_page_offset, column.data_page_offset
    assert 0 < dictionary < first_data
    metadata_len = int.from_bytes(data[-8:-4], "little")
    metadata_start = len(data) - 8 - metadata_len
    metadata = data[metadata_start:-8]
    # ColumnMetaData field 9 (data_page_offset), then field 11.
    written = thrift_i64(2, first_data) + thrift_i64(2, dictionary)
    assert metadata.count(written) == 1, "the offsets as pyarrow writes them"
    metadata = metadata.replace(written, thrift_i64(2, dictionary) + thrift_i64(2, 0))
    footer = len(metadata).to_bytes(4, "little") + b"PAR1"
    path.write_bytes(data[:metadata_start] + metadata + footer)


def test_a_dictionary_page_offset_of_zero_means_none(tmp_path):
    """parquet-mr wrote ``dictionary_page_offset = 0`` with the dictionary
    page first in the chunk (parquet-testing's dict-page-offset-zero.parquet):
    pyarrow and the Java reader take 0 as no offset and read the chunk from
    its data page offset; so does shardstream."""
    path = tmp_path / "dict-page-offset-zero.parquet"
    words = pa.array([["low", "mid", "high"][i % 3] for i in range(90)])
    pq.write_table(pa.table({"level": words}), path, use_dictionary=True)
    with_dictionary_page_offset_zero(path)
    column = pq.ParquetFile(path).metadata.row_group(0).column(0)
    assert (column.dictionary_page_offset, column.data_page_offset) in {(0, 4), (None, 4)}
    expected = pq.read_table(path).to_pylist()
    assert expected == [{"level": w} for w in words.to_pylist()]
    samples = collect(StreamingDataset(str(path), shuffle_buffer=0))
    assert [row_of(s) for s in samples] == expected
    assert [s["__key__"] for s in samples] == [str(i) for i in range(len(expected))]


def test_columns_that_leave_out_the_key_column_keep_the_keys(tmp_path):
    """Before, ``columns=`` without ``__key__`` keyed the rows by their
    numbers instead of the file's keys, without a word. Arrow batches hold
    the columns asked for, nothing more."""
    keyed = tmp_path / "keyed.parquet"
    table = pa.table({"v": [1, 2, 3], "__key__": ["img/a", "img/b", "img/c"], "t": ["x", "y", "z"]})
    pq.write_table(table, keyed, row_group_size=2)
    for columns in (None, ["t"], ["t", "v"], ["__key__", "t"]):
        rows = collect(
            StreamingDataset(str(keyed), shuffle_buffer=0, shuffle_shards=False, columns=columns)
        )
        assert [r["__key__"] for r in rows] == ["img/a", "img/b", "img/c"], columns
        assert [r["t"] for r in rows] == ["x", "y", "z"]
        assert all("__key__" not in {k for k in r if not k.startswith("__")} for r in rows)
    rows = collect(
        StreamingDataset(str(keyed), shuffle_buffer=0, shuffle_shards=False, columns=["t"])
    )
    assert list(rows[0]) == ["__key__", "__url__", "t"]
    batches = collect(
        StreamingDataset(
            str(keyed), batch_format="arrow", shuffle_buffer=0, shuffle_shards=False, columns=["t"]
        )
    )
    assert [b.schema.names for b in batches] == [["t"], ["t"]]


def test_a_damaged_arrow_schema_in_the_footer_is_named_without_a_debug_dump(tmp_path):
    """The footer stays valid; its ``ARROW:schema`` metadata does not: the
    error said what the flatbuffers reader's Debug form says."""
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"x": [1, 2, 3]}), path)
    data = bytearray(path.read_bytes())
    schema = pq.ParquetFile(path).metadata.metadata[b"ARROW:schema"]
    at = bytes(data).rindex(schema)
    raw = bytearray(base64.b64decode(schema))
    raw[0:4] = (0x7FFFFF00).to_bytes(4, "little")  # the root offset, far out of range
    damaged = base64.b64encode(bytes(raw))
    assert len(damaged) == len(schema)
    data[at : at + len(schema)] = damaged
    path.write_bytes(bytes(data))
    with pytest.raises(shardstream.ShardFormatError) as raised:
        collect(StreamingDataset(str(path), shuffle_buffer=0))
    message = str(raised.value)
    assert str(path) in message and "ARROW:schema metadata is damaged" in message, message
    assert not re.search(r"[A-Z][a-zA-Z]+ \{|\(\[\]\)", message), message


def test_columns_named_like_a_sample_s_own_names(tmp_path):
    """A string column ``__key__`` keys the rows (a file converted from
    WebDataset shards keeps its keys); a ``__url__``, ``__id__`` or
    ``__seed__`` column, or two columns of one name, would lose a value:
    each is a ``ShardFormatError`` naming the file and the column, and
    ``columns=`` or Arrow batches read the file. Before, the column
    replaced the sample's own (or was replaced by it), and of two columns
    the last was kept."""
    keyed = tmp_path / "keyed.parquet"
    pq.write_table(pa.table({"__key__": ["a/1", "a/2"], "v": [1, 2]}), keyed)
    rows = collect(StreamingDataset(str(keyed), shuffle_buffer=0, sample_ids=True))
    assert [(r["__key__"], r["v"], r["__id__"]) for r in rows] == [
        ("a/1", 1, (0, 0, 0)),
        ("a/2", 2, (0, 0, 1)),
    ]
    assert list(rows[0]) == ["__key__", "__url__", "v", "__id__"]

    named = tmp_path / "named.parquet"
    pq.write_table(pa.table({"__url__": ["u0", "u1"], "__id__": [10, 11], "v": [1, 2]}), named)
    twice = tmp_path / "twice.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array([1, 2]), pa.array([3, 4])], ["a", "a"]), twice)
    for path, column in ((named, "__url__"), (twice, "a")):
        with pytest.raises(shardstream.ShardFormatError) as raised:
            collect(StreamingDataset(str(path), shuffle_buffer=0))
        message = str(raised.value)
        assert str(path) in message and f'column "{column}"' in message, message
        assert "columns=" in message, message
    rows = collect(StreamingDataset(str(named), shuffle_buffer=0, columns=["v"]))
    assert [(r["__url__"], r["v"]) for r in rows] == [(str(named), 1), (str(named), 2)]
    batches = collect(StreamingDataset(str(named), batch_format="arrow", shuffle_buffer=0))
    assert batches[0].column("__url__").to_pylist() == ["u0", "u1"]

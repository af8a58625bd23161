"""``ShardWriter``: what it writes reads back sample for sample (with
shardstream and with webdataset 1.0.2), rolls over at its limits, keeps the
manifest ``shardstream index`` would write, leaves nothing half-written
locally or on S3 (moto's server), and refuses bad samples and options
naming them."""

from __future__ import annotations

import gc
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest
import webdataset as wds
from _shardtest import index_manifest, load_schema
from s3_server import s3_config as config

import shardstream
from shardstream import ShardWriter, StreamingDataset, _core
from shardstream.options import WriterOptions

WRITE_BUCKET = "written"


def sample(i: int) -> dict[str, Any]:
    """A sample with every kind of value the writer encodes."""
    return {
        "__key__": f"s{i:04d}",
        "jpg": hashlib.sha256(str(i).encode()).digest() * (i % 7 + 1),
        "txt": f"caption {i} é",
        "cls": i % 5,
        "json": {"i": i, "tags": ["a", "b"], "score": i / 3},
        "seg.id": float(i) + 0.5,
    }


def encoded(s: dict[str, Any]) -> dict[str, bytes]:
    """The fields as webdataset 1.0.2's own encoder writes them."""
    fields = wds.writer.encode_based_on_extension(s, wds.writer.default_handlers)
    return {k: v for k, v in fields.items() if k != "__key__"}


def read_all(root: Path | str, **options: Any) -> dict[str, dict[str, bytes]]:
    """Every sample of a dataset, by key (failing on a repeated key)."""
    out: dict[str, dict[str, bytes]] = {}
    for s in StreamingDataset(root, shuffle_shards=False, **options):
        key = s.pop("__key__")
        s.pop("__url__")
        assert key not in out, key
        out[key] = s
    return out


def files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize(
    ("compression", "suffix"), [(None, "tar"), ("gz", "tar.gz"), ("zst", "tar.zst")]
)
def test_round_trip_every_sample_once_with_the_manifest_index_writes(tmp_path, compression, suffix):
    out = tmp_path / "out"
    samples = [sample(i) for i in range(23)]
    with ShardWriter(out / f"shard-%06d.{suffix}", max_count=10, compression=compression) as w:
        for s in samples:
            w.write(s)
        assert len(w) == 23 and len(w.shards) == 2
    assert w.shards == [str(out / f"shard-{n:06d}.{suffix}") for n in range(3)]
    assert files(out) == sorted(["manifest.json", *(f"shard-{n:06d}.{suffix}" for n in range(3))])
    expected = {s["__key__"]: encoded(s) for s in samples}
    assert read_all(out) == expected
    # The manifest is what `shardstream index` makes of the same shards.
    ours = json.loads((out / "manifest.json").read_text())
    assert [e["samples"] for e in ours["shards"]] == [10, 10, 3]
    indexed = index_manifest([out / f"shard-{{000000..000002}}.{suffix}"], out / "indexed.json")
    assert ours == indexed
    import jsonschema

    jsonschema.validate(ours, load_schema("manifest"))


def test_webdataset_reads_our_shards_and_groups_them_the_same(tmp_path):
    samples = [sample(i) for i in range(12)]
    for suffix in ("tar", "tar.gz"):
        out = tmp_path / suffix
        with ShardWriter(out / f"s-%03d.{suffix}", max_count=5) as w:
            for s in samples:
                w.write(s)
        urls = [str(out / f"s-{n:03d}.{suffix}") for n in range(3)]
        theirs = {}
        for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
            key = s.pop("__key__")
            for meta in ("__url__", "__local_path__"):
                s.pop(meta, None)
            assert key not in theirs
            theirs[key] = s
        assert theirs == read_all(out) == {s["__key__"]: encoded(s) for s in samples}


def test_equal_length_epochs_and_len_work_at_once_from_the_manifest(tmp_path):
    with ShardWriter(tmp_path / "s-%02d.tar.gz", max_count=4) as w:
        for i in range(17):
            w.write({"__key__": f"k{i}", "txt": "x" * i})
    per_rank = []
    for rank in range(2):
        ds = StreamingDataset(tmp_path, world_size=2, rank=rank, count_samples=False)
        assert ds.manifest_path == str(tmp_path / "manifest.json")
        assert len(ds) == 8
        per_rank.append([s["__key__"] for s in ds])
    assert [len(keys) for keys in per_rank] == [8, 8]
    assert len(set(per_rank[0]) | set(per_rank[1])) == 16


def test_rollover_at_max_count_and_max_bytes(tmp_path):
    with ShardWriter(tmp_path / "c" / "%d.tar", max_count=3) as w:
        for i in range(10):
            w.write({"__key__": f"k{i}", "bin": b"x"})
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert [e["samples"] for e in manifest["shards"]] == [3, 3, 3, 1]
    # Each sample is 512 + 1024 bytes of tar; the end marker is 1024.
    with ShardWriter(tmp_path / "b" / "%d.tar", max_count=None, max_bytes=5 * 1536) as w:
        for i in range(9):
            w.write({"__key__": f"k{i}", "bin": b"y" * 1000})
        w.write({"__key__": "big", "bin": b"z" * 20000})
        w.write({"__key__": "last", "bin": b"y"})
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert [e["samples"] for e in manifest["shards"]] == [4, 4, 1, 1, 1]
    sizes = [(tmp_path / "b" / e["url"]).stat().st_size for e in manifest["shards"]]
    assert all(size <= 5 * 1536 for n, size in enumerate(sizes) if n != 3), sizes
    assert len(read_all(tmp_path / "b")) == 11


def test_an_exception_in_the_with_block_keeps_only_completed_shards(tmp_path):
    with (
        pytest.raises(RuntimeError, match="boom"),
        ShardWriter(tmp_path / "%d.tar", max_count=4) as w,
    ):
        for i in range(10):
            w.write({"__key__": f"k{i}", "txt": "a"})
        raise RuntimeError("boom")
    assert files(tmp_path) == ["0.tar", "1.tar", "manifest.json"]
    assert sorted(read_all(tmp_path)) == sorted(f"k{i}" for i in range(8))
    with pytest.raises(shardstream.ShardStreamError, match="closed"):
        w.write({"__key__": "late", "txt": "a"})


def test_a_writer_dropped_without_close_aborts_its_open_shard(tmp_path):
    w = ShardWriter(tmp_path / "%d.tar.zst", max_count=3)
    for i in range(5):
        w.write({"__key__": f"k{i}", "txt": "a"})
    assert any(name.endswith(".partial") for name in os.listdir(tmp_path))
    del w
    gc.collect()
    assert files(tmp_path) == ["0.tar.zst", "manifest.json"]
    assert sorted(read_all(tmp_path)) == ["k0", "k1", "k2"]


def test_bad_samples_are_refused_naming_key_and_field_and_write_nothing(tmp_path):
    w = ShardWriter(tmp_path / "%d.tar")
    w.write({"__key__": "ok", "txt": "a", "__url__": "ignored"})
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"txt": "a"}, ValueError, "__key__"),
        ({"__key__": 3, "txt": "a"}, TypeError, "__key__"),
        ({"__key__": "ok", "txt": "a"}, ValueError, "already written"),
        ({"__key__": "a.b", "txt": "a"}, ValueError, "'.'"),
        ({"__key__": "/abs", "txt": "a"}, ValueError, "'/'"),
        ({"__key__": "k"}, ValueError, "needs a field"),
        ({"__key__": "k", "JPG": b""}, ValueError, '"jpg"'),
        ({"__key__": "k", "a/b": b""}, ValueError, "'/'"),
        ({"__key__": "k", "": b""}, ValueError, "empty"),
        ({"__key__": "k", "_meta": "x"}, ValueError, "'_'"),
        ({"__key__": "k", ".jpg": b""}, ValueError, "'.'"),
        ({"__key__": "k", "npy": {1, 2}}, TypeError, "set"),
        ({"__key__": "k", "label": 3}, TypeError, ".cls"),
        ({"__key__": "k", "cls": {"a": 1}}, TypeError, ".json"),
        ({"__key__": "k", "json": {"a": object()}}, TypeError, "JSON"),
        ({"__key__": "k", "txt.gz": "text"}, TypeError, "gzip"),
        ({"__key__": "k", 5: b""}, TypeError, "str"),
        # A lone surrogate, as os.listdir gives for a name that is not
        # UTF-8: before, a bare UnicodeEncodeError naming neither.
        ({"__key__": "a\udc80", "txt": "a"}, ValueError, "__key__ 'a\\udc80' is not valid"),
        ({"__key__": "k", "t\udc80": "a"}, ValueError, "field name 't\\udc80'"),
        ({"__key__": "k", "txt": "\udc80"}, ValueError, 'sample "k", field "txt": the str'),
    ]
    for bad, error, says in cases:
        with pytest.raises(error, match=None) as info:
            w.write(bad)
        message = str(info.value)
        assert says in message, (bad, message)
        fields = [f for f in bad if isinstance(f, str) and f not in ("__key__", "txt")]
        if isinstance(bad.get("__key__"), str) and fields:
            shown = [repr(name).strip("'") for name in (bad["__key__"], fields[0])]
            assert all(name in message for name in shown), message
    with pytest.raises(TypeError, match="dict"):
        w.write([("__key__", "k")])  # type: ignore[arg-type]
    w.write({"__key__": "k2", "txt": "still fine"})
    w.close()
    assert read_all(tmp_path) == {"ok": {"txt": b"a"}, "k2": {"txt": b"still fine"}}


@pytest.mark.parametrize(
    ("pattern", "options", "error", "says"),
    [
        ("out/shard.tar", {}, ValueError, "pattern"),
        ("out/%d-%d.tar", {}, ValueError, "pattern"),
        ("out/%d.tar", {"compression": "gz"}, ValueError, "pattern"),
        ("out/%d.tar", {"compression": "lz4"}, ValueError, "compression"),
        ("out/%d.tar", {"max_count": 0}, ValueError, "max_count"),
        ("out/%d.tar", {"max_count": "3"}, TypeError, "max_count"),
        ("out/%d.tar", {"max_bytes": -1}, ValueError, "max_bytes"),
        ("out/%d.tar", {"max_bytes": 0}, ValueError, "max_bytes"),
        ("out/%d.tar", {"s3": {"part_size": 0}}, ValueError, "part_size"),
        ("out/%d.tar", {"colour": 1}, TypeError, "colour"),
        ("http://host/%d.tar", {}, ValueError, "pattern"),
    ],
)
def test_bad_options_are_refused_at_construction_naming_the_option(
    tmp_path, monkeypatch, pattern, options, error, says
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=says):
        ShardWriter(pattern, **options)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_writer_options_typed_dict_stub_and_core_agree():
    import ast
    import typing

    core = _core.default_writer_options()
    assert set(typing.get_type_hints(WriterOptions)) == set(core)
    stub = ast.parse(Path(shardstream.__file__).with_name("_core.pyi").read_text())
    for node in ast.walk(stub):
        if isinstance(node, ast.ClassDef) and node.name == "ShardWriter":
            new = next(
                n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__new__"
            )
            defaults = {
                a.arg: ast.literal_eval(d)
                for a, d in zip(new.args.kwonlyargs, new.args.kw_defaults, strict=True)
            }
            assert defaults == core
            return
    raise AssertionError("no ShardWriter in the stub")


@pytest.mark.usefixtures("s3_credentials")
def test_s3_multipart_upload_streams_parts_and_reads_back(s3, tmp_path):
    client = s3.client()
    client.create_bucket(Bucket=WRITE_BUCKET)
    part = 5 << 20
    blobs = [os.urandom(3 << 20) for _ in range(5)]  # 15 MiB and headers: four parts
    pattern = f"s3://{WRITE_BUCKET}/run1/shard-%04d.tar"
    with ShardWriter(pattern, max_count=None, s3=config(s3, part_size=part)) as w:
        for i, blob in enumerate(blobs):
            w.write({"__key__": f"k{i}", "bin": blob, "cls": i})
            if i == 2:
                # Parts go up while the shard is written.
                uploads = client.list_multipart_uploads(Bucket=WRITE_BUCKET).get("Uploads", [])
                assert len(uploads) == 1
        w.write({"__key__": "tail", "txt": "t"})
    assert w.shards == [f"s3://{WRITE_BUCKET}/run1/shard-0000.tar"]
    assert client.list_multipart_uploads(Bucket=WRITE_BUCKET).get("Uploads", []) == []
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=WRITE_BUCKET)["Contents"]]
    assert keys == ["run1/manifest.json", "run1/shard-0000.tar"]
    head = client.head_object(Bucket=WRITE_BUCKET, Key="run1/shard-0000.tar")
    parts = -(-head["ContentLength"] // part)
    assert parts == 4 and head["ETag"].endswith(f'-{parts}"'), head["ETag"]  # a multipart ETag
    manifest = json.loads(
        client.get_object(Bucket=WRITE_BUCKET, Key="run1/manifest.json")["Body"].read()
    )
    (entry,) = manifest["shards"]
    assert (entry["url"], entry["size"], entry["etag"]) == (
        f"s3://{WRITE_BUCKET}/run1/shard-0000.tar",
        head["ContentLength"],
        head["ETag"],
    )
    local = tmp_path / "manifest.json"
    local.write_text(json.dumps(manifest))
    got = read_all(f"s3://{WRITE_BUCKET}/run1/", s3=config(s3), manifest=local)
    assert got == {
        **{f"k{i}": {"bin": blob, "cls": str(i).encode()} for i, blob in enumerate(blobs)},
        "tail": {"txt": b"t"},
    }
    # Small shards are one PUT each; the manifest lists them all.
    with ShardWriter(f"s3://{WRITE_BUCKET}/run2/%d.tar.gz", max_count=2, s3=config(s3)) as w:
        for i in range(5):
            w.write({"__key__": f"k{i}", "txt": "x"})
    manifest = json.loads(
        client.get_object(Bucket=WRITE_BUCKET, Key="run2/manifest.json")["Body"].read()
    )
    assert [e["samples"] for e in manifest["shards"]] == [2, 2, 1]


@pytest.mark.usefixtures("s3_credentials")
def test_a_failure_mid_upload_leaves_no_object_and_no_pending_upload(s3):
    client = s3.client()
    client.create_bucket(Bucket="failing")
    part = 5 << 20

    def nothing_left(prefix: str) -> None:
        assert client.list_multipart_uploads(Bucket="failing").get("Uploads", []) == []
        assert client.list_objects_v2(Bucket="failing", Prefix=prefix).get("Contents", []) == []

    # A bad value after a part went up: the with block aborts the upload.
    with (
        pytest.raises(TypeError, match="bad"),
        ShardWriter("s3://failing/a/%d.tar", max_count=None, s3=config(s3, part_size=part)) as w,
    ):
        for i in range(3):
            w.write({"__key__": f"k{i}", "bin": os.urandom(3 << 20)})
        assert len(client.list_multipart_uploads(Bucket="failing").get("Uploads", [])) == 1
        w.write({"__key__": "bad", "bin": 1.5})
    nothing_left("a/")
    # The upload vanishes on the server mid-way: the next part fails, the
    # writer stops, and nothing is left.
    w = ShardWriter(
        "s3://failing/b/%d.tar", max_count=None, s3=config(s3, part_size=part, max_attempts=2)
    )
    for i in range(2):
        w.write({"__key__": f"k{i}", "bin": os.urandom(3 << 20)})
    (upload,) = client.list_multipart_uploads(Bucket="failing")["Uploads"]
    client.abort_multipart_upload(Bucket="failing", Key=upload["Key"], UploadId=upload["UploadId"])
    # Parts go up in the background: part 1 may still be in flight, so the
    # part that fails is 1 or 2, and its failure comes out of a later
    # write, or of close at the latest.
    with pytest.raises(shardstream.ShardWriteError, match=r"s3://failing/b/0\.tar.*part [12]:"):
        for i in range(2, 6):
            w.write({"__key__": f"k{i}", "bin": os.urandom(3 << 20)})
        w.close()
    with pytest.raises(shardstream.ShardStreamError, match="earlier failure"):
        w.write({"__key__": "after", "txt": "a"})
    w.abort()
    nothing_left("b/")


def test_cli_writes_a_folder_of_jpegs_with_csv_labels(tmp_path):
    from _shardtest import shardstream_cli
    from PIL import Image

    src = tmp_path / "images"
    (src / "train").mkdir(parents=True)
    expected = {}
    for i in range(9):
        path = src / "train" / f"img{i:02d}.jpg"
        Image.new("RGB", (8 + i, 8), (i * 20, 0, 0)).save(path, format="JPEG")
        expected[f"train/img{i:02d}"] = {"jpg": path.read_bytes(), "cls": str(i % 3).encode()}
    (src / "train" / "img00.seg.txt").write_text("mask")
    expected["train/img00"]["seg.txt"] = b"mask"
    (src / "NOTES").write_text("no extension: skipped")
    labels = tmp_path / "labels.csv"
    labels.write_text("key,cls\n" + "".join(f"train/img{i:02d},{i % 3}\n" for i in range(9)))
    out = tmp_path / "out"
    proc = shardstream_cli(
        "write", src, out / "shard-%03d.tar", "--labels", labels, "--max-count", "4"
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote 9 samples into 3 shards" in proc.stdout
    assert "1 files without an extension skipped" in proc.stdout
    assert read_all(out) == expected
    ds = StreamingDataset(out, world_size=2, rank=0, count_samples=False)
    assert len(ds) == 4

    # A label for a key with no files, a field that would not read back,
    # and a labels file repeating a key are refused before anything is left.
    for text, says in [
        ("key,cls\ntrain/img00,1\nmissing,2\n", 'line 3: key "missing" has no files'),
        ("key,Cls\ntrain/img00,1\n", 'read back as "cls"'),
        ("key,cls\ntrain/img00,1\ntrain/img00,2\n", "labelled twice"),
    ]:
        labels.write_text(text)
        bad_out = tmp_path / "bad"
        proc = shardstream_cli("write", src, bad_out / "%d.tar", "--labels", labels)
        assert proc.returncode == 1 and says in proc.stderr, proc.stderr
        assert (
            not any(n.endswith(".tar") for n in os.listdir(bad_out)) if bad_out.exists() else True
        )


def test_cli_writes_parquet_rows_as_samples(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from _shardtest import shardstream_cli

    table = pa.table(
        {
            "id": [f"r{i}" for i in range(7)],
            "image": [bytes([i]) * (i + 1) for i in range(7)],
            "label": list(range(7)),
            "score": [i / 4 for i in range(6)] + [None],
            "tags": [["a"]] * 7,
        }
    )
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=3)
    out = tmp_path / "out"
    proc = shardstream_cli(
        "write",
        tmp_path / "rows.parquet",
        out / "%d.tar.zst",
        "--key-column",
        "id",
        "--columns",
        "jpg=image,cls=label,score.json=score",
        "--max-count",
        "5",
    )
    assert proc.returncode == 0, proc.stderr
    expected = {}
    for i in range(7):
        s = {"__key__": f"r{i}", "jpg": bytes([i]) * (i + 1), "cls": i}
        if i < 6:
            s["score.json"] = i / 4
        expected[f"r{i}"] = encoded(s)
    assert read_all(out) == expected
    for columns, says in [("label", ".cls"), ("tags", "cannot be written"), ("nope", '"nope"')]:
        proc = shardstream_cli(
            "write", tmp_path / "rows.parquet", tmp_path / "x" / "%d.tar", "--key-column", "id",
            "--columns", columns,
        )  # fmt: skip
        assert proc.returncode == 1 and says in proc.stderr, proc.stderr
    pq.write_table(
        pa.table({"id": ["a", "b", "a"], "txt": ["1", "2", "3"]}), tmp_path / "d.parquet"
    )
    proc = shardstream_cli(
        "write", tmp_path / "d.parquet", tmp_path / "d" / "%d.tar", "--key-column", "id"
    )
    assert proc.returncode == 1 and 'sample "a": this key was already written' in proc.stderr
    assert not any(n.endswith(".tar") for n in os.listdir(tmp_path / "d"))


@pytest.mark.usefixtures("s3_credentials")
def test_uploads_are_retried_like_reads(s3):
    from fault_proxy import Faults, running_fault_proxy

    client = s3.client()
    client.create_bucket(Bucket="retried")
    blobs = [os.urandom(2 << 20) for _ in range(4)]
    with running_fault_proxy(s3.endpoint_url, Faults(write_slowdown_every=2)) as proxy:
        options = config(proxy.endpoint_url, part_size=5 << 20)
        with ShardWriter("s3://retried/x/%d.tar", max_count=None, s3=options) as w:
            for i, blob in enumerate(blobs):
                w.write({"__key__": f"k{i}", "bin": blob})
        # Create, two parts, complete and the manifest: every second one
        # answered 503 SlowDown first.
        assert proxy.injected.write_slowdowns >= 2
        assert proxy.injected.writes >= 2 * proxy.injected.write_slowdowns
    assert client.list_multipart_uploads(Bucket="retried").get("Uploads", []) == []
    body = client.get_object(Bucket="retried", Key="x/0.tar")["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar}  # type: ignore[union-attr]
    assert got == {f"k{i}.bin": blob for i, blob in enumerate(blobs)}


def part_uploads(requests: list[tuple[str, str]]) -> list[str]:
    """The UploadPart requests among a proxy's writes."""
    return [path for method, path in requests if method == "PUT" and "partNumber=" in path]


@pytest.mark.usefixtures("s3_credentials")
def test_parts_upload_together_in_order(s3):
    """With 0.3 s before the store answers each upload, parts overlap (at
    most four in flight) and the object reads back byte for byte."""
    from fault_proxy import Faults, running_fault_proxy

    client = s3.client()
    client.create_bucket(Bucket="together")
    blobs = [os.urandom(2 << 20) for _ in range(14)]  # 28 MiB and headers: six parts
    with running_fault_proxy(s3.endpoint_url, Faults(write_delay=0.3)) as proxy:
        options = config(proxy.endpoint_url, part_size=5 << 20)
        with ShardWriter("s3://together/x/%d.tar", max_count=None, s3=options) as w:
            for i, blob in enumerate(blobs):
                w.write({"__key__": f"k{i}", "bin": blob})
        assert len(part_uploads(proxy.injected.write_requests)) == 6
        assert 2 <= proxy.injected.max_writes_active <= 4, proxy.injected.max_writes_active
    assert client.list_multipart_uploads(Bucket="together").get("Uploads", []) == []
    head = client.head_object(Bucket="together", Key="x/0.tar")
    assert head["ETag"].endswith('-6"'), head["ETag"]
    body = client.get_object(Bucket="together", Key="x/0.tar")["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        names = [m.name for m in tar]
        got = {m.name: tar.extractfile(m).read() for m in tar}  # type: ignore[union-attr]
    assert names == [f"k{i}.bin" for i in range(len(blobs))]
    assert got == {f"k{i}.bin": blob for i, blob in enumerate(blobs)}


@pytest.mark.usefixtures("s3_credentials")
def test_a_failing_part_stops_the_others_and_aborts_the_upload(s3):
    """Part 3 is refused (500, both attempts) while other parts are in
    flight: the writer raises naming the part, and neither the object nor a
    pending upload is left."""
    from fault_proxy import Faults, running_fault_proxy

    client = s3.client()
    client.create_bucket(Bucket="refused")
    blobs = [os.urandom(2 << 20) for _ in range(14)]
    with running_fault_proxy(s3.endpoint_url, Faults(write_delay=0.1, fail_part=3)) as proxy:
        options = config(proxy.endpoint_url, part_size=5 << 20, max_attempts=2)
        w = ShardWriter("s3://refused/x/%d.tar", max_count=None, s3=options)
        with pytest.raises(shardstream.ShardWriteError, match=r"s3://refused/x/0\.tar.*part 3"):
            for i, blob in enumerate(blobs):
                w.write({"__key__": f"k{i}", "bin": blob})
            w.close()
        assert proxy.injected.failed_parts == 2
        requests = proxy.injected.write_requests
        assert any(m == "DELETE" and "uploadId=" in p for m, p in requests), requests
        assert not any(m == "POST" and "uploadId=" in p for m, p in requests), "never completed"
    assert client.list_multipart_uploads(Bucket="refused").get("Uploads", []) == []
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="refused").get("Contents", [])]
    assert "x/0.tar" not in keys, keys


@pytest.mark.usefixtures("s3_credentials")
def test_a_forked_child_is_refused_its_parents_s3_writer_and_the_parent_goes_on(s3):
    """The parts go up on the writer's own threads, which a forked child
    does not have: there a write that would upload fails at once (never a
    hang), and the parent's shard still completes."""
    import time

    client = s3.client()
    client.create_bucket(Bucket="forked")
    blobs = [os.urandom(3 << 20) for _ in range(3)]
    w = ShardWriter("s3://forked/x/%d.tar", max_count=None, s3=config(s3, part_size=5 << 20))
    w.write({"__key__": "k0", "bin": blobs[0]})
    w.write({"__key__": "k1", "bin": blobs[1]})  # part 1 goes up
    pid = os.fork()
    if pid == 0:
        code = 2
        try:
            w.write({"__key__": "child", "bin": os.urandom(6 << 20)})
            code = 3
        except shardstream.ShardWriteError as e:
            code = 0 if "forked" in str(e) else 4
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while (ended := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    if ended == (0, 0):
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise AssertionError("the forked child hung on its parent's writer")
    assert os.waitstatus_to_exitcode(ended[1]) == 0
    w.write({"__key__": "k2", "bin": blobs[2]})
    w.close()
    body = client.get_object(Bucket="forked", Key="x/0.tar")["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar}  # type: ignore[union-attr]
    assert got == {f"k{i}.bin": blob for i, blob in enumerate(blobs)}


@pytest.mark.usefixtures("s3_credentials")
def test_a_missing_bucket_or_no_credentials_are_refused_at_construction(s3, monkeypatch, tmp_path):
    with pytest.raises(ValueError, match=r'pattern.*"no-such-bucket" does not exist'):
        ShardWriter("s3://no-such-bucket/x/%d.tar", s3=config(s3))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    empty = tmp_path / "empty"
    empty.write_text("")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(shardstream.StorageAuthError, match="s3://written-nocreds/"):
        ShardWriter("s3://written-nocreds/x/%d.tar", s3=config(s3))


FORK_SCRIPT = """
import os, sys, time
from shardstream import ShardWriter, ShardWriteError

out, child_writes = sys.argv[1], sys.argv[2] == "write"
w = ShardWriter(os.path.join(out, "shard-%06d.tar"), max_count=None)
w.write({"__key__": "parent0", "bin": b"p" * 1000})
pid = os.fork()
if pid == 0:
    if child_writes:
        try:
            w.write({"__key__": "child", "bin": b"c" * 1000})
            print("child-wrote", flush=True)
        except ShardWriteError as e:
            print("child-refused" if "forked" in str(e) else f"child-other {e}", flush=True)
        try:
            w.close()
            print("child-closed", flush=True)
        except ShardWriteError:
            print("child-close-refused", flush=True)
    # A normal exit: the interpreter finalises the writer here.
    sys.exit(0)
deadline = time.monotonic() + 60
while os.waitpid(pid, os.WNOHANG) == (0, 0):
    if time.monotonic() > deadline:
        os.kill(pid, 9)
        sys.exit("the child hung")
    time.sleep(0.02)
w.write({"__key__": "parent1", "bin": b"q" * 1000})
w.close()
print("parent-closed", flush=True)
"""


@pytest.mark.parametrize("child_writes", [False, True], ids=["child-exits", "child-writes"])
def test_a_forked_child_neither_writes_nor_removes_its_parents_local_shard(tmp_path, child_writes):
    """A child forked from a process with an open local writer shares its
    temporary file: at its normal exit it must not remove it (the parent's
    ``close()`` would fail and the shard be lost), and a write or close from
    it is a ``ShardWriteError``, never a shard mixing both processes."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT, str(tmp_path), "write" if child_writes else "exit"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.split()
    if child_writes:
        assert lines[:2] == ["child-refused", "child-close-refused"], run.stdout
    assert lines[-1] == "parent-closed", run.stdout
    assert read_all(tmp_path) == {
        "parent0": {"bin": b"p" * 1000},
        "parent1": {"bin": b"q" * 1000},
    }
    assert files(tmp_path) == ["manifest.json", "shard-000000.tar"]


def test_one_writer_shared_by_threads_writes_every_sample_once(tmp_path):
    """Calls from several threads take turns (each waiting with the GIL
    released), never ``RuntimeError: Already borrowed``."""
    import threading

    w = ShardWriter(str(tmp_path / "shard-%06d.tar"), max_count=50)
    errors: list[BaseException] = []

    def write(thread: int) -> None:
        try:
            for i in range(200):
                w.write({"__key__": f"t{thread}-{i:03d}", "bin": os.urandom(2000)})
                len(w), len(w.shards)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    w.close()
    got = read_all(tmp_path)
    assert sorted(got) == sorted(f"t{t}-{i:03d}" for t in range(4) for i in range(200))
    assert len(w) == 800 and len(w.shards) == 16


def test_manifest_json_and_write_manifest_merge_writers(tmp_path):
    """Two writers' ``manifest_json`` entries, merged by ``write_manifest``, are
    the manifest ``shardstream index`` writes; bad entries are refused."""
    from shardstream.writer import write_manifest

    merged = []
    for part in range(2):
        with ShardWriter(tmp_path / f"p{part}-%d.tar", max_count=2) as w:
            for i in range(3):
                w.write({"__key__": f"k{part}{i}", "txt": "x" * i})
        assert json.loads(w.manifest_json) == json.loads((tmp_path / "manifest.json").read_text())
        merged += json.loads(w.manifest_json)["shards"]
    write_manifest(tmp_path / "manifest.json", merged)
    got = json.loads((tmp_path / "manifest.json").read_text())
    assert got == index_manifest([tmp_path], tmp_path / "index.json")
    (tmp_path / "index.json").unlink()
    assert len(read_all(tmp_path)) == 6
    bad = [{**merged[0], "samples": 5}]
    with pytest.raises(shardstream.ManifestError, match=r"bad\.json"):
        write_manifest(tmp_path / "bad.json", bad)
    assert not (tmp_path / "bad.json").exists()

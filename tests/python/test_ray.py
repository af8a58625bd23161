"""``shardstream.ray`` on a real local Ray cluster (``ray.init(num_cpus=2)``):
the datasink writes 20,000 samples as shards locally and to moto's S3 that
shardstream and webdataset read back exactly once, with the manifest
``shardstream index`` writes; a write task killed mid-way and retried leaves
no duplicate; the index fan-out writes the one-machine index's manifest."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import webdataset as wds
from _shardtest import index_manifest, load_schema, shardstream_cli
from ray.data.block import BlockAccessor
from s3_server import TEST_KEY_ID, TEST_SECRET
from s3_server import s3_config as config

import shardstream
from shardstream import ShardWriter, StreamingDataset
from shardstream.ray import ShardDatasink, index

N = 20_000
BUCKET = "ray-written"


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """A local Ray cluster of 2 CPUs whose workers have the S3 test keys."""
    with pytest.MonkeyPatch.context() as env:
        # Workers inherit the environment the cluster starts with.
        env.setenv("AWS_ACCESS_KEY_ID", TEST_KEY_ID)
        env.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
            env.delenv(name, raising=False)
        env.setenv("RAY_AUTH_MODE", "disabled")
        # The datasinks defined here are imported by the workers.
        env.setenv("PYTHONPATH", str(Path(__file__).parent), prepend=os.pathsep)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        try:
            yield
        finally:
            ray.shutdown()


def keys_once(samples: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The samples by key, failing on a key seen twice."""
    out: dict[str, dict[str, Any]] = {}
    for s in samples:
        key = s["__key__"]
        assert key not in out, f"{key} read twice"
        out[key] = {k: v for k, v in s.items() if not k.startswith("__")}
    return out


def entries(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["url"]: e for e in manifest["shards"]}


def indexed(out: Path) -> dict[str, dict[str, Any]]:
    """The entries ``shardstream index out -o out/index.json`` writes."""
    manifest = index_manifest([out], out / "index.json")
    (out / "index.json").unlink()
    return entries(manifest)


@pytest.mark.usefixtures("cluster")
def test_range_to_local_shards_reads_back_once_with_the_index_manifest(tmp_path: Path) -> None:
    out = tmp_path / "out"
    ds = ray.data.range(N, override_num_blocks=6)
    ds.write_datasink(ShardDatasink(out, max_count=1500))
    names = sorted(os.listdir(out))
    shards = [n for n in names if n != "manifest.json"]
    assert names == ["manifest.json", *shards]
    assert all(n.startswith("shard-") and n.endswith(".tar") for n in shards), names
    tasks = {n.split("-")[1] for n in shards}
    assert len(tasks) > 1, shards  # several write tasks wrote them
    manifest = json.loads((out / "manifest.json").read_text())
    jsonschema.validate(manifest, load_schema("manifest"))
    assert [e["url"] for e in manifest["shards"]] == shards
    assert sum(e["samples"] for e in manifest["shards"]) == N
    # The manifest shardstream index writes for the same shards.
    assert entries(manifest) == indexed(out)

    ours = keys_once(StreamingDataset(out, shuffle_shards=False, shuffle_buffer=0))
    assert sorted(int(s["id"]) for s in ours.values()) == list(range(N))
    theirs = keys_once(wds.WebDataset([str(out / n) for n in shards], shardshuffle=False))
    assert theirs.keys() == ours.keys()
    assert all(theirs[k]["id"] == ours[k]["id"] for k in ours)


@pytest.mark.usefixtures("cluster")
def test_items_to_s3_shards_read_back_once(s3: Any, tmp_path: Path) -> None:
    client = s3.client()
    client.create_bucket(Bucket=BUCKET)
    items = [{"__key__": f"s{i:05d}", "txt": f"caption {i}", "cls": i % 10} for i in range(N)]
    ds = ray.data.from_items(items, override_num_blocks=4)
    sink = ShardDatasink(f"s3://{BUCKET}/items/", max_count=3000, s3=config(s3))
    ds.write_datasink(sink)
    assert sink.manifest_url == f"s3://{BUCKET}/items/manifest.json"
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=BUCKET)["Contents"])
    shards = [k for k in keys if k != "items/manifest.json"]
    assert keys == ["items/manifest.json", *shards]
    assert client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []
    body = client.get_object(Bucket=BUCKET, Key="items/manifest.json")["Body"].read()
    manifest = json.loads(body)
    jsonschema.validate(manifest, load_schema("manifest"))
    assert [e["url"] for e in manifest["shards"]] == [f"s3://{BUCKET}/{k}" for k in shards]
    for e, key in zip(manifest["shards"], shards, strict=True):
        assert e["etag"] == client.head_object(Bucket=BUCKET, Key=key)["ETag"]

    # shardstream finds the manifest beside the shards.
    ds_read = StreamingDataset(
        f"s3://{BUCKET}/items/", s3=config(s3), shuffle_shards=False, count_samples=True
    )
    assert len(ds_read) == N
    ours = keys_once(ds_read)
    want = {i["__key__"]: {"txt": i["txt"].encode(), "cls": str(i["cls"]).encode()} for i in items}
    assert ours == want
    local = tmp_path / "copy"
    local.mkdir()
    for key in shards:
        client.download_file(BUCKET, key, str(local / key.split("/")[-1]))
    theirs = keys_once(wds.WebDataset(sorted(map(str, local.iterdir())), shardshuffle=False))
    assert theirs == want


class KilledOnce(ShardDatasink):
    """Kills the worker process of the write task holding ``victim`` once,
    after it has written 3,000 of that task's rows (the marker file holds
    what was under the output then)."""

    def __init__(self, path: Path, marker: Path, victim: int, **options: Any) -> None:
        super().__init__(path, **options)
        self.marker = str(marker)
        self.victim = victim

    def write(self, blocks: Iterable[Any], ctx: Any) -> Any:
        def pieces() -> Iterator[Any]:
            for block in blocks:
                rows = BlockAccessor.for_block(block)
                ids = rows.to_arrow().column("id").to_pylist()
                for start in range(0, rows.num_rows(), 1000):
                    if start == 3000 and self.victim in ids and not os.path.exists(self.marker):
                        with open(self.marker, "w") as f:
                            json.dump({"task": ctx.task_idx, "names": os.listdir(self.path)}, f)
                        os._exit(1)
                    yield rows.slice(start, min(start + 1000, rows.num_rows()))

        return super().write(pieces(), ctx)


@pytest.mark.usefixtures("cluster")
def test_a_write_task_killed_mid_way_is_retried_without_duplicates(tmp_path: Path) -> None:
    out, marker = tmp_path / "out", tmp_path / "killed"
    ds = ray.data.range(N, override_num_blocks=4)
    ds.write_datasink(KilledOnce(out, marker, victim=12_345, max_count=500))
    # The first attempt had completed shards and one half-written.
    killed = json.loads(marker.read_text())
    task, seen = killed["task"], killed["names"]
    assert f"shard-{task:06d}-000004.tar" in seen, seen
    assert [n for n in seen if n.startswith(f".shard-{task:06d}-000005.tar.")], seen
    names = sorted(os.listdir(out))
    manifest = json.loads((out / "manifest.json").read_text())
    assert names == sorted(["manifest.json", *(e["url"] for e in manifest["shards"])])
    got = collections.Counter(
        int(s["id"]) for s in StreamingDataset(out, shuffle_shards=False, shuffle_buffer=0)
    )
    assert got == collections.Counter(range(N))
    assert entries(manifest) == indexed(out)


class ChangedOnRetry(ShardDatasink):
    """Kills the worker of the task holding ``victim`` once, after it wrote all
    its rows; the retry gets 1,000 rows fewer (an upstream that changed)."""

    def __init__(self, path: Path, marker: Path, victim: int, **options: Any) -> None:
        super().__init__(path, **options)
        self.marker = str(marker)
        self.victim = victim

    def write(self, blocks: Iterable[Any], ctx: Any) -> Any:
        first = not os.path.exists(self.marker)
        tables = [BlockAccessor.for_block(b).to_arrow() for b in blocks]
        ours = any(self.victim in t.column("id").to_pylist() for t in tables)
        if ours and not first:
            tables = [t.slice(0, t.num_rows - 1000) for t in tables]
        result = super().write(tables, ctx)
        if ours and first:
            with open(self.marker, "w") as f:
                json.dump(sorted(os.listdir(self.path)), f)
            os._exit(1)
        return result


@pytest.mark.usefixtures("cluster")
def test_shards_only_an_earlier_attempt_wrote_are_removed(tmp_path: Path) -> None:
    out, marker = tmp_path / "out", tmp_path / "killed"
    ds = ray.data.range(N, override_num_blocks=4)
    ds.write_datasink(ChangedOnRetry(out, marker, victim=12_345, max_count=500))
    seen = json.loads(marker.read_text())
    names = sorted(os.listdir(out))
    manifest = json.loads((out / "manifest.json").read_text())
    assert names == sorted(["manifest.json", *(e["url"] for e in manifest["shards"])])
    gone = sorted(n for n in set(seen) - set(names) if not n.endswith(".partial"))
    assert len(gone) == 2 and all(n.endswith(("-000008.tar", "-000009.tar")) for n in gone), gone
    got = collections.Counter(
        int(s["id"]) for s in StreamingDataset(out, shuffle_shards=False, shuffle_buffer=0)
    )
    assert got == collections.Counter(i for i in range(N) if not 14_000 <= i < 15_000)


@pytest.mark.usefixtures("cluster")
def test_a_path_holding_shards_is_refused(tmp_path: Path) -> None:
    with ShardWriter(tmp_path / "old-%d.tar") as w:
        w.write({"__key__": "a", "txt": "x"})
    with pytest.raises(ValueError, match=r"path: .* already holds 1 shards"):
        ray.data.range(10).write_datasink(ShardDatasink(tmp_path))
    with pytest.raises(ValueError, match="prefix"):
        ShardDatasink(tmp_path / "new", prefix="a.b")
    with pytest.raises(ValueError, match="max_count"):
        ShardDatasink(tmp_path / "new", max_count=0)


@pytest.mark.usefixtures("cluster")
def test_index_fan_out_equals_the_one_machine_index(s3: Any, tmp_path: Path) -> None:
    local = tmp_path / "data"
    with ShardWriter(local / "part-%04d.tar", max_count=700) as w:
        for i in range(N // 4):
            w.write({"__key__": f"k{i:05d}", "txt": f"t{i}" * (i % 13 + 1)})
    (local / "manifest.json").unlink()
    one = index_manifest([local], local / "one.json")
    assert index(local, local / "fan.json", num_tasks=3) == str(local / "fan.json")
    fan = json.loads((local / "fan.json").read_text())
    assert fan == one
    assert not [n for n in os.listdir(local) if n.startswith(".")]
    # JSON-lines shards (format="jsonl", as `shardstream index --format jsonl`).
    lines = tmp_path / "lines"
    lines.mkdir()
    for part in range(4):
        docs = [json.dumps({"text": f"d{part}-{i}"}) for i in range(10 + part)]
        (lines / f"p-{part}.jsonl").write_text("\n".join(docs) + "\n")
    one = index_manifest([lines, "--format", "jsonl"], lines / "one.json")
    assert index(lines, lines / "fan.json", num_tasks=2, format="jsonl") == str(lines / "fan.json")
    assert json.loads((lines / "fan.json").read_text()) == one
    assert [e["samples"] for e in one["shards"]] == [10, 11, 12, 13]
    with pytest.raises(ValueError, match='format must be "tar" or "jsonl"'):
        index(lines, lines / "x.json", format="parquet")  # type: ignore[arg-type]

    client = s3.client()
    client.create_bucket(Bucket="indexed")
    with ShardWriter("s3://indexed/d/%04d.tar.gz", max_count=900, s3=config(s3)) as w:
        for i in range(N // 4):
            w.write({"__key__": f"k{i:05d}", "txt": f"t{i}"})
    client.delete_object(Bucket="indexed", Key="d/manifest.json")
    flags = ["--s3-endpoint-url", s3.endpoint_url, "--s3-path-style", "--s3-region", "us-east-1"]
    proc = shardstream_cli("index", *flags, "s3://indexed/d/", "-o", tmp_path / "one-s3.json")
    assert proc.returncode == 0, proc.stderr
    one = json.loads((tmp_path / "one-s3.json").read_text())
    assert len(one["shards"]) == 6
    index("s3://indexed/d/", "s3://indexed/d/manifest.json", num_tasks=4, s3=config(s3))
    fan = json.loads(client.get_object(Bucket="indexed", Key="d/manifest.json")["Body"].read())
    assert fan == one
    ds = StreamingDataset("s3://indexed/d/", s3=config(s3), count_samples=True)
    assert len(ds) == N // 4
    assert isinstance(ds, shardstream.StreamingDataset)


@pytest.mark.usefixtures("cluster")
def test_index_fan_out_takes_listed_names_literally(tmp_path: Path) -> None:
    """A shard named ``b{1,2}.tar`` that a listing found is indexed as that
    file, not expanded again into ``b1.tar`` and ``b2.tar``."""
    local = tmp_path / "braces"
    for tag, name in enumerate(("a", "b{1,2}", "c{0..1}")):
        with ShardWriter(local / f"{name}-%d.tar", max_count=10) as w:
            for i in range(15):
                w.write({"__key__": f"k{tag}-{i:02d}", "txt": f"t{i}"})
        (local / "manifest.json").unlink()
    one = index_manifest([local], local / "one.json")
    assert [e["url"] for e in one["shards"]] == sorted(
        f"{name}-{n}.tar" for name in ("a", "b{1,2}", "c{0..1}") for n in (0, 1)
    )
    index(local, local / "fan.json", num_tasks=2)
    assert json.loads((local / "fan.json").read_text()) == one


def test_import_shardstream_does_not_import_ray() -> None:
    code = "import sys, shardstream; assert 'ray' not in sys.modules, 'ray imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr

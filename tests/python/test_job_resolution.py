"""One resolution per job: under torchrun with an initialised process
group, rank 0 lists the dataset and the other ranks receive the resolved
shard list, so a job of N ranks makes one listing's requests, not N; a
resolution error reaches every rank as the same error. Real processes:
torchrun with 4 ranks (gloo), moto's S3 server behind a proxy that counts
requests, and the fake Hub, which counts its API calls."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

import pytest
from _shardtest import index_manifest, run_bounded, write_uneven_dataset
from fake_hub import running_fake_hub
from fault_proxy import running_fault_proxy
from http_server import running_http_server
from s3_server import TEST_KEY_ID, TEST_SECRET

from shardstream import StreamingDataset

pytestmark = pytest.mark.timeout(300)

NPROC = 4
BUCKET = "one-resolution"
COUNTS = (3, 5, 2, 7, 4, 6)

RANK_SCRIPT = """
import json, os, sys
import torch.distributed as dist
from shardstream import StreamingDataset

spec, options, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
if len(sys.argv) > 4 and sys.argv[4] == "no-process-group":
    rank = int(os.environ["RANK"])
else:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
if os.environ.get("NODE_DIRS"):
    # A node of its own: relative paths name this rank's copies.
    os.chdir(f"node-{rank}")
try:
    # A transform that does not pickle: the shard list travels without it.
    ds = StreamingDataset(spec, transform=lambda sample: sample, **options)
    record = {"rank": rank, "shards": [u for u, _ in ds.shards]}
    if options.get("count_samples"):
        record["length"] = len(ds)
    if os.environ.get("READ_SAMPLES"):
        record["keys"] = [sample["__key__"] for sample in ds]
except Exception as e:
    record = {"rank": rank, "error": f"{type(e).__name__}: {e}"}
with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
    json.dump(record, f)
if dist.is_initialized():
    dist.destroy_process_group()
"""


def launch(
    tmp_path: Path, spec: str, options: dict, env: dict[str, str], *extra: str
) -> list[dict]:
    """Makes ``StreamingDataset(spec, **options)`` on every rank of a
    torchrun job; returns each rank's record."""
    out = tmp_path / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    run_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        run_env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", str(NPROC), str(script), spec, json.dumps(options), str(out)]
    command += extra
    proc = run_bounded(command, cwd=tmp_path, env=run_env, timeout=240)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-5000:]}"
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(NPROC)]


@pytest.fixture
def s3_shards(s3, tmp_path) -> tuple[str, Path]:
    """The uneven dataset under ``s3://BUCKET/train/``, and its manifest."""
    client = s3.client()
    client.create_bucket(Bucket=BUCKET)
    info = write_uneven_dataset(tmp_path / "local", COUNTS)
    for path in info.paths:
        client.upload_file(str(path), BUCKET, f"train/{path.name}")
    return info, client


def list_requests(reads: list[tuple[str, str]]) -> list[str]:
    return [path for method, path in reads if method == "GET" and "list-type=2" in path]


@pytest.mark.usefixtures("s3_credentials")
def test_the_ranks_of_a_job_list_an_s3_prefix_once(s3, s3_shards, tmp_path):
    info, _ = s3_shards
    spec = f"s3://{BUCKET}/train/"
    with running_fault_proxy(s3.endpoint_url) as proxy:
        s3_options = {"endpoint_url": proxy.endpoint_url, "region": "us-east-1", "path_style": True}
        # One listing's requests, made here by one process.
        alone = StreamingDataset(spec, s3=s3_options, manifest=False)
        one_listing = list_requests(proxy.injected.reads)
        assert len(alone.shards) == len(COUNTS) and len(one_listing) >= 1
        proxy.reset()
        env = {"AWS_ACCESS_KEY_ID": TEST_KEY_ID, "AWS_SECRET_ACCESS_KEY": TEST_SECRET}
        records = launch(
            tmp_path,
            spec,
            {
                "s3": s3_options,
                "count_samples": False,
                "manifest": False,
                "world_size": 1,
                "rank": 0,
            },
            env,
        )
        job_listing = list_requests(proxy.injected.reads)
    assert [r.get("error") for r in records] == [None] * NPROC, records
    assert all(r["shards"] == [u for u, _ in alone.shards] for r in records)
    assert len(job_listing) == len(one_listing), (job_listing, one_listing)
    assert len(info.keys) == sum(COUNTS)


@pytest.mark.usefixtures("s3_credentials")
def test_a_resolution_error_reaches_every_rank_as_the_same_error(s3, tmp_path):
    with running_fault_proxy(s3.endpoint_url) as proxy:
        s3_options = {"endpoint_url": proxy.endpoint_url, "region": "us-east-1", "path_style": True}
        env = {"AWS_ACCESS_KEY_ID": TEST_KEY_ID, "AWS_SECRET_ACCESS_KEY": TEST_SECRET}
        records = launch(
            tmp_path,
            "s3://no-such-bucket-here/train/",
            {"s3": s3_options, "world_size": 1, "rank": 0},
            env,
        )
        lists = list_requests(proxy.injected.reads)
    errors = {r["error"] for r in records}
    assert len(errors) == 1 and None not in errors, records
    (error,) = errors
    assert "no-such-bucket-here" in error
    assert len(lists) <= 1, lists


def test_the_ranks_of_a_job_ask_the_hub_once(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    info = write_uneven_dataset(root / "org" / "data" / "train", COUNTS)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with running_http_server(root) as cdn, running_fake_hub(root, cdn.base_url) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.base_url)
        spec = "hf://datasets/org/data/train/*.tar"
        alone = StreamingDataset(spec, manifest=False)
        one = sum(hub.requests.values())
        assert len(alone.shards) == len(info.paths) and one >= 2
        hub.requests.clear()
        records = launch(tmp_path, spec, {"manifest": False, "world_size": 1, "rank": 0}, {})
        job = sum(hub.requests.values())
    assert [r.get("error") for r in records] == [None] * NPROC, records
    assert all(r["shards"] == [u for u, _ in alone.shards] for r in records)
    assert job == one, (job, one)


@pytest.mark.usefixtures("s3_credentials")
def test_before_the_process_group_the_processes_of_a_node_list_once(s3, s3_shards, tmp_path):
    """Datasets made before ``init_process_group`` (torchrun's processes of
    one node): the first resolves, the others read its result from a file
    of a directory private to the user."""
    spec = f"s3://{BUCKET}/train/"
    with running_fault_proxy(s3.endpoint_url) as proxy:
        s3_options = {"endpoint_url": proxy.endpoint_url, "region": "us-east-1", "path_style": True}
        env = {"AWS_ACCESS_KEY_ID": TEST_KEY_ID, "AWS_SECRET_ACCESS_KEY": TEST_SECRET}
        options = {"s3": s3_options, "manifest": False, "world_size": 1, "rank": 0}
        records = launch(tmp_path, spec, options, env, "no-process-group")
        listings = list_requests(proxy.injected.reads)
    assert [r.get("error") for r in records] == [None] * NPROC, records
    assert len({tuple(r["shards"]) for r in records}) == 1
    assert len(records[0]["shards"]) == len(COUNTS)
    assert len(listings) == 1, listings


def test_a_resolution_over_8_mib_reaches_every_rank(tmp_path):
    """A resolution larger than a store value may be (the default store
    server drops a client sending over 8 MiB): 30,000 raw objects with long
    names, sent in parts, every rank gets the whole list and no rank
    resolves by itself (before, rank 0 failed with a connection reset)."""
    from shardstream import _core
    from shardstream.job_resolution import PART_BYTES, _encoded

    root = tmp_path / "objects"
    root.mkdir()
    names = [f"{i:06d}-{'x' * 193}.bin" for i in range(30_000)]
    for name in names:
        (root / name).write_bytes(b"1")
    options = {"format": "raw", "manifest": False}
    encoded = _encoded(_core.ShardList([f"{root}/"], _core.Options(**options)))
    assert len(encoded) > 8 << 20 >= 2 * PART_BYTES  # 3 parts or more
    records = launch(tmp_path, f"{root}/", options, {})
    assert [r.get("error") for r in records] == [None] * NPROC
    assert [len(r["shards"]) for r in records] == [len(names)] * NPROC
    assert all(r["shards"] == records[0]["shards"] for r in records)
    assert sorted(Path(u).name for u in records[0]["shards"]) == names


@pytest.mark.usefixtures("s3_credentials")
def test_count_samples_reads_remote_shards_once_spread_over_the_ranks(s3, s3_shards, tmp_path):
    """``count_samples=True`` on an S3 prefix without a manifest: the shards
    are indexed at start-up, each rank reading a quarter of them and the
    parts gathered, so the job reads each shard's bytes once (not once per
    rank) and every rank gets the same number of samples, each once."""
    info, client = s3_shards
    stored = sum(
        client.head_object(Bucket=BUCKET, Key=f"train/{p.name}")["ContentLength"]
        for p in info.paths
    )
    spec = f"s3://{BUCKET}/train/"
    with running_fault_proxy(s3.endpoint_url) as proxy:
        s3_options = {"endpoint_url": proxy.endpoint_url, "region": "us-east-1", "path_style": True}
        env = {"AWS_ACCESS_KEY_ID": TEST_KEY_ID, "AWS_SECRET_ACCESS_KEY": TEST_SECRET}
        options = {"s3": s3_options, "count_samples": True, "shuffle_buffer": 0}
        # Resolution and counting only: no rank reads its samples yet.
        records = launch(tmp_path, spec, options, env)
        counting_bytes = proxy.injected.body_bytes
    assert [r.get("error") for r in records] == [None] * NPROC, records
    # Each shard once (plus listings), where every rank counting alone read 4x.
    assert stored <= counting_bytes < stored * 1.5, (counting_bytes, stored)
    per_rank = sum(COUNTS) // NPROC
    assert [r["length"] for r in records] == [per_rank] * NPROC


@pytest.mark.usefixtures("s3_credentials")
def test_count_samples_on_remote_shards_gives_equal_ranks_each_sample_once(s3, s3_shards, tmp_path):
    info, _ = s3_shards
    spec = f"s3://{BUCKET}/train/"
    s3_options = {"endpoint_url": s3.endpoint_url, "region": "us-east-1", "path_style": True}
    env = {"AWS_ACCESS_KEY_ID": TEST_KEY_ID, "AWS_SECRET_ACCESS_KEY": TEST_SECRET}
    options = {"s3": s3_options, "count_samples": True}
    records = launch(tmp_path, spec, options, dict(env, READ_SAMPLES="1"))
    assert [r.get("error") for r in records] == [None] * NPROC, records
    per_rank = sum(COUNTS) // NPROC
    assert [len(r["keys"]) for r in records] == [per_rank] * NPROC
    union = [k for r in records for k in r["keys"]]
    assert len(set(union)) == len(union) == per_rank * NPROC
    assert set(union) <= set(info.keys)


@pytest.mark.usefixtures("s3_credentials")
def test_count_samples_on_remote_shards_in_one_process(s3, s3_shards):
    """Without a process group the process reads every shard through; ranks
    made this way (``world_size=2``) split the samples evenly, each once,
    where without ``count_samples=True`` the dataset refuses to start."""
    info, _ = s3_shards
    spec = f"s3://{BUCKET}/train/"
    s3_options = {"endpoint_url": s3.endpoint_url, "region": "us-east-1", "path_style": True}
    from shardstream import DatasetSpecError

    with pytest.raises(DatasetSpecError, match="shardstream index"):
        StreamingDataset(spec, s3=s3_options, world_size=2, rank=0)
    keys = []
    for rank in range(2):
        ds = StreamingDataset(spec, s3=s3_options, world_size=2, rank=rank, count_samples=True)
        assert len(ds) == sum(COUNTS) // 2
        keys += [sample["__key__"] for sample in ds]
    assert len(keys) == len(set(keys)) == sum(COUNTS) // 2 * 2
    assert set(keys) <= set(info.keys)


@pytest.mark.usefixtures("s3_credentials")
def test_count_samples_keeps_the_counts_in_cache_dir(s3, s3_shards, tmp_path):
    """The counts read at start-up are kept in ``cache_dir``: the next start
    reads no shard, until an object is replaced (another ETag), when every
    shard is read again and the new counts planned with."""
    info, client = s3_shards
    stored = sum(p.stat().st_size for p in info.paths)
    # What a count must read: each shard up to its last member's end (the
    # end-of-archive blocks and padding after it may go unread).
    members = sum(members_end(p) for p in info.paths)
    spec = f"s3://{BUCKET}/train/"
    with running_fault_proxy(s3.endpoint_url) as proxy:
        s3_options = {"endpoint_url": proxy.endpoint_url, "region": "us-east-1", "path_style": True}
        options = {"s3": s3_options, "world_size": 2, "rank": 0, "count_samples": True}
        options["cache_dir"] = str(tmp_path / "cache")
        assert len(StreamingDataset(spec, **options)) == sum(COUNTS) // 2
        assert proxy.injected.body_bytes >= members, (proxy.injected.body_bytes, members)
        kept = list((tmp_path / "cache").glob("*.counts.json"))
        assert len(kept) == 1
        proxy.reset()
        assert len(StreamingDataset(spec, **options)) == sum(COUNTS) // 2
        assert proxy.injected.body_bytes < stored / 4, proxy.injected.body_bytes
        # Shard 1 replaced by shard 0's bytes: its ETag and count change.
        client.upload_file(str(info.paths[0]), BUCKET, f"train/{info.paths[1].name}")
        proxy.reset()
        counts = [COUNTS[0], COUNTS[0], *COUNTS[2:]]
        assert len(StreamingDataset(spec, **options)) == sum(counts) // 2
        assert proxy.injected.body_bytes >= members - members_end(info.paths[1])


def members_end(path: Path) -> int:
    """The offset in the tar file `path` where its last member's data
    (padded to 512 bytes) ends: what reading every member takes."""
    with tarfile.open(path) as tar:
        last = tar.getmembers()[-1]
    return last.offset_data + -(-last.size // 512) * 512


@pytest.mark.usefixtures("s3_credentials")
def test_count_samples_on_remote_shards_named_outright(s3, s3_shards, tmp_path):
    """Shards named by a brace range (not listed, so without sizes): they
    are described, then read; no counts are kept for shards listed without
    an ETag."""
    info, _ = s3_shards
    stems = [p.stem for p in info.paths]
    spec = f"s3://{BUCKET}/train/{stems[0][:-1]}{{{stems[0][-1]}..{stems[-1][-1]}}}.tar"
    s3_options = {"endpoint_url": s3.endpoint_url, "region": "us-east-1", "path_style": True}
    options = {"s3": s3_options, "world_size": 2, "rank": 1, "count_samples": True}
    ds = StreamingDataset(spec, cache_dir=str(tmp_path / "cache"), **options)
    assert len(ds) == sum(COUNTS) // 2
    assert len({sample["__key__"] for sample in ds}) == sum(COUNTS) // 2
    assert not list((tmp_path / "cache").glob("*.counts.json"))


def test_each_rank_checks_its_own_copies_of_the_local_shards_at_construction(tmp_path):
    """Rank 0's resolution of a local spec reaches every rank, and each
    reads its own node's copies by rank 0's sample spans: each checks them
    (a stat each: present, same size, the modification time the manifest
    records) when it makes the dataset, so that a node with a missing or
    other file fails there, naming it, not mid-epoch."""
    info = write_uneven_dataset(tmp_path / "node-0" / "data", COUNTS)
    index_manifest([info.spec], tmp_path / "node-0" / "data" / "manifest.json")
    for rank in range(1, NPROC):
        shutil.copytree(tmp_path / "node-0", tmp_path / f"node-{rank}")  # times kept
    (tmp_path / "node-2" / "data" / info.paths[3].name).unlink()
    touched = tmp_path / "node-3" / "data" / info.paths[1].name
    stat = touched.stat()
    os.utime(touched, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    spec = f"data/part-{{000000..{len(COUNTS) - 1:06d}}}.tar"
    records = launch(tmp_path, spec, {"shuffle_buffer": 0}, {"NODE_DIRS": "1"})
    assert [r.get("error") for r in records[:2]] == [None, None], records
    assert records[0]["shards"] == records[1]["shards"]
    missing, other = records[2].get("error", ""), records[3].get("error", "")
    assert missing.startswith("ShardNotFoundError") and info.paths[3].name in missing, missing
    assert other.startswith("ManifestMismatchError") and info.paths[1].name in other, other
    assert "modification time" in other, other

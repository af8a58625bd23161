"""``shardstream.ddp_check`` (``torchrun -m``) under torchrun: two CPU ranks (gloo), two
DataLoader workers each, rank and world size taken from torch.distributed,
shards on local disk and on S3 (moto's server on loopback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _shardtest import (
    UNEVEN_COUNTS,
    assert_exactly_once,
    run_bounded,
    write_uneven_dataset,
)
from s3_server import BUCKET, TEST_KEY_ID, TEST_SECRET

from shardstream import _core

LAUNCH_TIMEOUT = 240
# The check ships in the package: torchrun runs it as a module.
DDP_CHECK = ["-m", "shardstream.ddp_check"]
NPROC = 2
WORKERS = 2


def run_torchrun(
    args: list[str], cwd, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs torchrun in its own process group; on timeout kills the group
    (launcher and ranks) and fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(NPROC),
        *args,
    ]
    return run_bounded(command, cwd=cwd, env=env, timeout=LAUNCH_TIMEOUT)


def launch_check(spec: str, tmp_path, epoch: int, *extra: str, env=None) -> list[dict]:
    """Runs ``shardstream.ddp_check`` under torchrun; returns every rank's record."""
    out_dir = tmp_path / "out"
    args = [*DDP_CHECK, spec, str(out_dir), "--workers", str(WORKERS)]
    args += ["--epoch", str(epoch), "--seed", "13", *extra]
    proc = run_torchrun(args, cwd=tmp_path, env=env)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-5000:]}"
    assert "ok:" in proc.stdout
    assert sorted(out_dir.iterdir()) == [out_dir / f"rank-{r}.json" for r in range(NPROC)]
    return [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in range(NPROC)]


@pytest.mark.parametrize("epoch", [0, 1])
def test_ddp_ranks_split_the_dataset(dataset, tmp_path, epoch):
    records = launch_check(dataset.spec, tmp_path, epoch)
    per_rank = []
    for rank, record in enumerate(records):
        assert record["rank"] == rank
        assert record["world_size"] == NPROC
        assert record["num_workers"] == WORKERS
        assert record["epoch"] == epoch
        keys = record["keys"]
        assert len(keys) == len(set(keys)), f"rank {rank} read a key twice"
        assert keys, f"rank {rank} read nothing"
        # Spawned workers count in the rank's shared counters.
        assert record["stats"]["samples"] == len(keys)
        per_rank.append(keys)
    assert not set(per_rank[0]) & set(per_rank[1])
    assert_exactly_once(per_rank[0] + per_rank[1], dataset.keys)


def test_ddp_uneven_local_shards_without_manifest_give_equal_ranks(tmp_path):
    """No manifest: the local tar shards are counted from their headers at
    construction, so both ranks get the same number of samples (before,
    one rank got 300 samples, the other 200, and DDP hung)."""
    info = write_uneven_dataset(tmp_path / "data")
    records = launch_check(info.spec, tmp_path, 0)
    per_rank = [record["keys"] for record in records]
    total = sum(UNEVEN_COUNTS)
    assert [len(keys) for keys in per_rank] == [total // NPROC] * NPROC
    union = per_rank[0] + per_rank[1]
    assert len(set(union)) == len(union)
    assert set(union) <= set(info.keys)
    assert len(set(info.keys) - set(union)) == total % NPROC


def test_ddp_over_an_s3_prefix_needs_sample_counts(s3, s3_dataset, tmp_path, monkeypatch):
    """Remote shards without counts: every rank refuses to start, naming
    `shardstream index`; with the manifest it writes, ranks split the
    prefix exactly once, with equal counts."""
    env = {"AWS_ACCESS_KEY_ID": TEST_KEY_ID, "AWS_SECRET_ACCESS_KEY": TEST_SECRET}
    spec = f"s3://{BUCKET}/audio/"
    out_dir = tmp_path / "refused"
    args = [*DDP_CHECK, spec, str(out_dir)]
    args += ["--s3-endpoint-url", s3.endpoint_url]
    proc = run_torchrun(args, cwd=tmp_path, env=env)
    assert proc.returncode != 0
    assert "DatasetSpecError" in proc.stderr and "shardstream index" in proc.stderr
    manifest = tmp_path / "manifest.json"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cli = ["shardstream", "--s3-endpoint-url", s3.endpoint_url, "--s3-path-style"]
    cli += ["--s3-region", "us-east-1"]
    assert _core.run_cli([*cli, "index", spec, "-o", str(manifest)]) == 0
    records = launch_check(
        spec,
        tmp_path,
        0,
        "--s3-endpoint-url",
        s3.endpoint_url,
        "--manifest",
        str(manifest),
        env=env,
    )
    keys = [key for record in records for key in record["keys"]]
    assert len({len(record["keys"]) for record in records}) == 1
    expected = list(s3_dataset["expected"])
    assert len(keys) == len(expected) - len(expected) % NPROC
    assert len(set(keys)) == len(keys) and set(keys) <= set(expected)

"""``examples/ddp_check.py`` under torchrun: two CPU ranks (gloo), two
DataLoader workers each, rank and world size taken from torch.distributed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _shardtest import EXAMPLES_DIR, assert_exactly_once, run_bounded

LAUNCH_TIMEOUT = 240
NPROC = 2
WORKERS = 2


def run_torchrun(args: list[str], cwd) -> subprocess.CompletedProcess[str]:
    """Runs torchrun in its own process group; on timeout kills the group
    (launcher and ranks) and fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
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


@pytest.mark.parametrize("epoch", [0, 1])
def test_ddp_ranks_split_the_dataset(dataset, tmp_path, epoch):
    out_dir = tmp_path / "out"
    script = EXAMPLES_DIR / "ddp_check.py"
    args = [str(script), dataset.spec, str(out_dir), "--workers", str(WORKERS)]
    args += ["--epoch", str(epoch), "--seed", "13"]
    proc = run_torchrun(args, cwd=tmp_path)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-5000:]}"

    records = [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in range(NPROC)]
    assert sorted(out_dir.iterdir()) == [out_dir / f"rank-{r}.json" for r in range(NPROC)]
    per_rank = []
    for rank, record in enumerate(records):
        assert record["rank"] == rank
        assert record["world_size"] == NPROC
        assert record["num_workers"] == WORKERS
        assert record["epoch"] == epoch
        keys = record["keys"]
        assert len(keys) == len(set(keys)), f"rank {rank} read a key twice"
        assert keys, f"rank {rank} read nothing"
        # Forked workers count in the rank's shared counters.
        assert record["stats"]["samples"] == len(keys)
        per_rank.append(keys)
    assert not set(per_rank[0]) & set(per_rank[1])
    assert_exactly_once(per_rank[0] + per_rank[1], dataset.keys)
    assert "ok:" in proc.stdout

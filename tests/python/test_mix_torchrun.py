"""``examples/mix_model_parallel.py`` under torchrun: 4 CPU ranks (gloo) as
2 data-parallel groups of 2 model-parallel ranks, each with 2 DataLoader
workers, reading a weighted mixture of two streams."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from _shardtest import EXAMPLES_DIR, run_bounded, write_uneven_dataset

LAUNCH_TIMEOUT = 240
NPROC = 4
MODEL_PARALLEL = 2


def test_model_parallel_groups_read_identical_batches_and_split_the_streams(tmp_path):
    a = write_uneven_dataset(tmp_path / "a", (10, 20, 30, 6), prefix="a", seed=1)
    b = write_uneven_dataset(tmp_path / "b", (7, 8, 9), prefix="b", seed=2)
    out_dir = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", str(NPROC), str(EXAMPLES_DIR / "mix_model_parallel.py")]
    command += [a.spec, b.spec, str(out_dir), "--weights", "0.6", "0.4"]
    command += ["--policy", "continue", "--model-parallel-size", str(MODEL_PARALLEL)]
    command += ["--workers", "2", "--batch-size", "4", "--seed", "7"]
    proc = run_bounded(command, cwd=tmp_path, env=env, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-5000:]}"
    records = [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in range(NPROC)]
    for rank, record in enumerate(records):
        assert record["rank"] == rank
        assert record["data_parallel_rank"] == rank // MODEL_PARALLEL
        assert record["data_parallel_size"] == NPROC // MODEL_PARALLEL
    # Ranks of one model-parallel group: identical batches, in order.
    assert records[0]["batches"] == records[1]["batches"]
    assert records[2]["batches"] == records[3]["batches"]
    # Equal batch counts: the same in every rank, and the collective agreed.
    assert len({len(r["batches"]) for r in records}) == 1
    assert all(r["max_batches"] == len(r["batches"]) for r in records)
    groups = [[k for batch in records[g]["batches"] for k in batch] for g in (0, 2)]
    assert all(len(keys) == len(set(keys)) for keys in groups)
    assert not set(groups[0]) & set(groups[1])
    expected = {f"a/{k}" for k in a.keys} | {f"b/{k}" for k in b.keys}
    assert set(groups[0]) | set(groups[1]) == expected
    assert Path(out_dir).is_dir()

"""``examples/dcp_resume.py`` under torchrun (2 CPU ranks, gloo, 2 DataLoader
workers each): the loader state of every rank saved mid-epoch through
``torch.distributed.checkpoint`` and loaded by a new job resumes exactly on
both ranks, and a job of one rank and 3 workers takes over from it
elastically. Each job writes the sample ledger (``--ledger``), which
``shardstream verify`` proves, resumes included."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
from _shardtest import (
    EXAMPLES_DIR,
    assert_exactly_once,
    assert_verified,
    run_bounded,
    write_uneven_dataset,
)

LAUNCH_TIMEOUT = 240
NPROC = 2


def launch(spec: str, tmp_path, out: str, *extra: str, nproc: int = NPROC) -> list[list[str]]:
    """Runs dcp_resume.py under torchrun with ``nproc`` ranks (bounded: on
    timeout its process groups are killed); returns each rank's keys."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", str(nproc), str(EXAMPLES_DIR / "dcp_resume.py")]
    command += [spec, str(tmp_path / "ckpt"), str(tmp_path / out), "--seed", "11", *extra]
    proc = run_bounded(command, cwd=tmp_path, env=env, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-5000:]}"
    records = [json.loads((tmp_path / out / f"rank-{r}.json").read_text()) for r in range(nproc)]
    assert [r["rank"] for r in records] == list(range(nproc))
    assert all(r["world_size"] == nproc for r in records)
    return [r["keys"] for r in records]


STEPS = 3


@pytest.fixture(scope="module")
def saved_job(tmp_path_factory):
    """A dataset, the keys of one uninterrupted epoch on each of 2 ranks,
    and a job's checkpoint after STEPS batches per rank with the keys each
    rank read before it."""
    tmp_path = tmp_path_factory.mktemp("dcp")
    info = write_uneven_dataset(tmp_path / "data")
    full = launch(info.spec, tmp_path, "full", "--ledger", str(tmp_path / "ledger-full"))
    assert_verified(tmp_path / "ledger-full", epochs=1)
    ledger = ["--ledger", str(tmp_path / "ledger-save")]
    saved = launch(info.spec, tmp_path, "save", "--steps", str(STEPS), *ledger)
    assert (tmp_path / "ckpt" / ".metadata").is_file()
    return tmp_path, info, full, saved


def ledger_of_the_saved_job(tmp_path, name: str) -> list[str]:
    """A copy of the saved job's ledger for a resumed job to continue."""
    shutil.copytree(tmp_path / "ledger-save", tmp_path / name)
    return ["--ledger", str(tmp_path / name)]


@pytest.mark.timeout(900)  # several launched jobs, each bounded; `make test` shares the cores
def test_a_dcp_checkpoint_resumes_every_rank_exactly(saved_job):
    tmp_path, info, full, saved = saved_job
    # Two ranks of equal length that split the dataset (86 samples: none dropped).
    assert len(full[0]) == len(full[1]) == len(info.keys) // NPROC
    assert_exactly_once(full[0] + full[1], info.keys)
    ledger = ledger_of_the_saved_job(tmp_path, "ledger-resume")
    resumed = launch(info.spec, tmp_path, "resume", "--resume", *ledger)
    assert_verified(tmp_path / "ledger-resume", epochs=1)
    for rank in range(NPROC):
        assert len(saved[rank]) == 4 * STEPS
        assert saved[rank] + resumed[rank] == full[rank], f"rank {rank}"


def test_a_dcp_checkpoint_resumes_elastically_on_another_layout(saved_job):
    tmp_path, info, _, saved = saved_job
    extra = ["--elastic-from", str(NPROC), "--workers", "3"]
    extra += ledger_of_the_saved_job(tmp_path, "ledger-elastic")
    (resumed,) = launch(info.spec, tmp_path, "elastic", *extra, nproc=1)
    assert_verified(tmp_path / "ledger-elastic", epochs=1)
    # One rank: nothing dropped, every sample the old job had not read once.
    assert_exactly_once(saved[0] + saved[1] + resumed, info.keys)

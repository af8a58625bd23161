"""Lightning Fabric, for real: ``Fabric(strategy="ddp", devices=2,
accelerator="cpu")`` under torchrun, every rank SIGKILLed mid-epoch, the run
resumed from its last checkpoint (``examples/fabric_resume.py``).

``fabric.save`` writes rank 0's objects only: a loader saved as it is
comes back as rank 0's state and rank 1 refuses it (``StateMismatchError``);
``shardstream.lightning.all_rank_states`` / ``load_rank_state`` save every
rank's and give each its own."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from _shardtest import EXAMPLES_DIR, assert_verified, run_bounded
from torch.utils.data import DataLoader

from shardstream import StreamingDataset
from shardstream.lightning import all_rank_states, load_rank_state

NPROC = 2
LAUNCH_TIMEOUT = 240
KILL_AT = 17  # 12 steps per epoch (96 samples, 2 ranks, batches of 4): mid-epoch 1


def launch(args: list[str], cwd: Path) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", str(NPROC), str(EXAMPLES_DIR / "fabric_resume.py"), *args]
    proc = run_bounded(command, cwd=cwd, env=env, timeout=LAUNCH_TIMEOUT)
    return proc.returncode, proc.stderr


def steps(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"steps-rank{rank}.jsonl").read_text().splitlines()]


@pytest.mark.timeout(900)  # several launched jobs, each bounded; `make test` shares the cores
def test_ddp_run_killed_mid_epoch_resumes_exactly_on_every_rank(dataset, tmp_path):
    """Checkpoints every 5 steps through ``fabric.save`` with
    ``all_rank_states``; the run killed at step 17 resumes from step 15's
    checkpoint (``fabric.load`` and ``load_rank_state``) and every rank
    trains on exactly the batches of the uninterrupted run from step 16 on.
    The ledger of each job (``--ledger``: ``Ledger.track`` and
    ``checkpoint``) verifies, the killed and resumed one across both runs."""
    full, killed, resumed = tmp_path / "full", tmp_path / "killed", tmp_path / "resumed"
    rc, stderr = launch([dataset.spec, "--out", str(full), "--ledger", str(full / "L")], tmp_path)
    assert rc == 0, stderr[-6000:]
    for rank in range(NPROC):
        assert [s["step"] for s in steps(full, rank)] == list(range(1, 25))
    for epoch in (0, 1):
        keys = [
            k
            for r in range(NPROC)
            for s in steps(full, r)
            if s["epoch"] == epoch
            for k in s["keys"]
        ]
        assert sorted(keys) == sorted(dataset.keys), f"epoch {epoch}"

    assert_verified(full / "L", epochs=2)
    ledger = ["--ledger", str(tmp_path / "ledger")]
    rc, stderr = launch(
        [dataset.spec, "--out", str(killed), "--kill-at", str(KILL_AT), *ledger], tmp_path
    )
    assert rc != 0
    for rank in range(NPROC):
        assert steps(killed, rank)[-1]["step"] == KILL_AT - 1
    checkpoint = killed / "ckpt" / "last.ckpt"
    rc, stderr = launch(
        [dataset.spec, "--out", str(resumed), "--resume", str(checkpoint), *ledger], tmp_path
    )
    assert rc == 0, stderr[-6000:]
    assert_verified(tmp_path / "ledger", epochs=2)
    for rank in range(NPROC):
        got = steps(resumed, rank)
        assert [s["step"] for s in got] == list(range(16, 25)), f"rank {rank}"
        assert got == steps(full, rank)[15:], f"rank {rank}"


@pytest.mark.timeout(900)  # several launched jobs, each bounded; `make test` shares the cores
def test_loader_saved_as_it_is_is_refused_by_rank_1(dataset, tmp_path):
    """What the helpers are for: the loader itself in Fabric's state is
    saved as rank 0's state, and rank 1 refuses it on resume."""
    killed, resumed = tmp_path / "killed", tmp_path / "resumed"
    flags = [dataset.spec, "--loader-as-is", "--epochs", "1"]
    rc, _ = launch([*flags, "--out", str(killed), "--kill-at", "7"], tmp_path)
    assert rc != 0
    assert (killed / "ckpt" / "last.ckpt").is_file()
    rc, stderr = launch(
        [*flags, "--out", str(resumed), "--resume", str(killed / "ckpt" / "last.ckpt")], tmp_path
    )
    assert rc != 0
    assert "StateMismatchError" in stderr, stderr[-6000:]
    assert "the state is for rank 0" in stderr and "this stream is rank 1" in stderr


def test_one_process_states_are_the_loaders_own_and_a_plain_loader_is_refused(dataset):
    """Outside ``torch.distributed``: ``all_rank_states`` is the loader's own
    state, and ``load_rank_state`` loads it; a loader without a state is a
    ``TypeError`` naming the function."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def keys(samples: list[dict]) -> list[str]:
        return [s["__key__"] for s in samples]

    loader = StatefulDataLoader(
        StreamingDataset(dataset.spec, seed=0), batch_size=4, collate_fn=keys
    )
    iterator = iter(loader)
    first = [next(iterator) for _ in range(3)]
    state = all_rank_states(loader)
    assert state == loader.state_dict()
    rest = list(iterator)
    again = StatefulDataLoader(
        StreamingDataset(dataset.spec, seed=0), batch_size=4, collate_fn=keys
    )
    load_rank_state(again, state)
    assert list(again) == rest
    assert sorted(k for batch in first + rest for k in batch) == sorted(dataset.keys)
    with pytest.raises(TypeError, match="all_rank_states needs a loader with a state"):
        all_rank_states(DataLoader(StreamingDataset(dataset.spec)))

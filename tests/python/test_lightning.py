"""PyTorch Lightning, for real: ``Trainer(strategy="ddp", devices=2,
accelerator="cpu")`` under torchrun, every rank SIGKILLed mid-epoch, the run
resumed from its last checkpoint (``examples/lightning_resume.py``).

Without ``shardstream.lightning.ShardStreamCallback`` the checkpoint holds
rank 0's loader state only and rank 1 refuses it (``StateMismatchError``: the
state is for rank 0), and a plain DataLoader restarted at Lightning's epoch 1
streams shardstream's epoch 0 again."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from _shardtest import EXAMPLES_DIR, key_batch, run_bounded

NPROC = 2
LAUNCH_TIMEOUT = 240
KILL_AT = 17  # 12 steps per epoch (96 samples, 2 ranks, batches of 4): mid-epoch 1


def launch(args: list[str], cwd: Path) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", str(NPROC), str(EXAMPLES_DIR / "lightning_resume.py"), *args]
    proc = run_bounded(command, cwd=cwd, env=env, timeout=LAUNCH_TIMEOUT)
    return proc.returncode, proc.stderr


def steps(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"steps-rank{rank}.jsonl").read_text().splitlines()]


@pytest.mark.timeout(900)  # several launched jobs, each bounded; `make test` shares the cores
@pytest.mark.parametrize("loader", ["stateful", "plain"])
def test_ddp_run_killed_mid_epoch_resumes_exactly_on_every_rank(dataset, tmp_path, loader):
    """``stateful``: a ``StatefulDataLoader``, checkpoints every 5 steps;
    the run killed at step 17 resumes from step 15's checkpoint and every
    rank trains on exactly the batches of the uninterrupted run from step
    16 on. ``plain``: a torch DataLoader, checkpoints at epoch ends; the
    resumed run streams Lightning's epoch 1, as the uninterrupted run did."""
    flags = [dataset.spec] + (["--plain-loader"] if loader == "plain" else [])
    full, killed, resumed = tmp_path / "full", tmp_path / "killed", tmp_path / "resumed"
    rc, stderr = launch([*flags, "--out", str(full)], tmp_path)
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

    rc, stderr = launch([*flags, "--out", str(killed), "--kill-at", str(KILL_AT)], tmp_path)
    assert rc != 0
    for rank in range(NPROC):
        assert steps(killed, rank)[-1]["step"] == KILL_AT - 1
    rc, stderr = launch(
        [*flags, "--out", str(resumed), "--resume", str(killed / "ckpt" / "last.ckpt")], tmp_path
    )
    assert rc == 0, stderr[-6000:]
    first = 16 if loader == "stateful" else 13  # after the last checkpoint
    for rank in range(NPROC):
        got = steps(resumed, rank)
        assert [s["step"] for s in got] == list(range(first, 25)), f"rank {rank}"
        assert got == steps(full, rank)[first - 1 :], f"rank {rank}"


def test_the_callback_keeps_the_state_of_the_epoch_in_progress(uneven_dataset, tmp_path):
    """In one process with ``num_workers=0``: the callback's ``set_epoch``
    in ``on_train_epoch_start`` comes after Lightning made the epoch's
    iterator; the checkpoint after 3 steps still holds the stream that was
    read, and the run resumed from it trains on exactly the rest."""
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer
    from torchdata.stateful_dataloader import StatefulDataLoader

    import shardstream
    from shardstream.lightning import ShardStreamCallback

    class Recorder(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.seen: list[list[str]] = []

        def training_step(self, batch: list[str], batch_idx: int) -> torch.Tensor:
            self.seen.append(batch)
            return self.layer(torch.ones(1, 1)).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ckpt = tmp_path / "step3.ckpt"

    class SaveAtStep3(Callback):
        def on_train_batch_end(self, trainer: Trainer, *args: object) -> None:
            if trainer.global_step == 3:
                trainer.save_checkpoint(ckpt)

    def fit(callbacks: list[Callback], resume: Path | None = None) -> Recorder:
        ds = shardstream.StreamingDataset(uneven_dataset.spec, seed=3, shuffle_buffer=5)
        dl = StatefulDataLoader(ds, batch_size=4, collate_fn=key_batch)
        model = Recorder()
        trainer = Trainer(
            max_epochs=1,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ShardStreamCallback(), *callbacks],
            default_root_dir=tmp_path,
        )
        trainer.fit(model, dl, ckpt_path=resume)
        return model

    full = fit([SaveAtStep3()]).seen
    assert len(full) == 22
    rest = fit([], ckpt).seen
    assert full[:3] + rest == full

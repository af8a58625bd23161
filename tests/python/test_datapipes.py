"""``shardstream.datapipes.StreamingPipe`` under torchdata 0.9's ``DataLoader2``
(``MultiProcessingReadingService``, and with ``DistributedReadingService``
under torchrun): each rank and worker streams exactly its slot of the plan,
epoch after epoch.

DataLoader2 left torchdata after 0.9, so torchdata 0.9 is installed into a
directory of its own (``build/torchdata-0.9``, from
``tests/requirements-dataloader2.txt``) and put first on the path of the
processes the test starts; the pipe itself needs only torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from _shardtest import REPO_ROOT, assert_exactly_once, collect, keys_of, run_bounded
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

import shardstream
from shardstream.datapipes import StreamingPipe

REQUIREMENTS = REPO_ROOT / "tests" / "requirements-dataloader2.txt"
TARGET = REPO_ROOT / "build" / "torchdata-0.9"
SCRIPT = Path(__file__).with_name("dataloader2_check.py")
SEED, SHUFFLE, WORKERS, RANKS, EPOCHS = 3, 5, 2, 2, 2
TIMEOUT = 300


@pytest.fixture(scope="module")
def torchdata_09() -> Path:
    """The directory torchdata 0.9 is installed in (installed once)."""
    (pin,) = [line for line in REQUIREMENTS.read_text().splitlines() if line.startswith("torch")]
    version = pin.split("==")[1]
    marker = TARGET / f"torchdata-{version}.dist-info"
    if not marker.is_dir():
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        proc = subprocess.run(
            [*pip, "--no-deps", "--upgrade", "--target", str(TARGET), "-r", str(REQUIREMENTS)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
        assert proc.returncode == 0, f"installing {pin} failed:\n{proc.stdout}\n{proc.stderr}"
    assert marker.is_dir()
    return TARGET


def environment(torchdata: Path) -> dict[str, str]:
    """torchdata 0.9 first on the path, then this shardstream."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    package_root = Path(shardstream.__file__).parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(torchdata), str(package_root)])
    return env


def expected_slot(info, rank: int, world_size: int, worker: int, epoch: int) -> list[str]:
    """A slot's keys for an epoch, streamed in this process."""
    ds = shardstream.StreamingDataset(
        info.spec,
        seed=SEED,
        shuffle_buffer=SHUFFLE,
        rank=rank,
        world_size=world_size,
        num_workers=WORKERS,
        worker_id=worker,
    )
    ds.set_epoch(epoch)
    return keys_of(collect(ds))


def check_rank(info, record: dict, rank: int, world_size: int) -> list[list[str]]:
    """Each epoch of a rank: two worker processes, each streaming exactly
    its slot, in order. Returns the rank's keys per epoch."""
    assert record["torchdata"].startswith("0.9.")
    assert record["rank"] == rank
    per_epoch = []
    for epoch, pairs in enumerate(record["epochs"]):
        by_pid: dict[int, list[str]] = defaultdict(list)
        for pid, key in pairs:
            by_pid[pid].append(key)
        expected = {tuple(expected_slot(info, rank, world_size, w, epoch)) for w in range(WORKERS)}
        assert len(by_pid) == WORKERS
        assert {tuple(keys) for keys in by_pid.values()} == expected
        per_epoch.append([key for _, key in pairs])
    return per_epoch


def run_check(torchdata: Path, info, out: Path, *, distributed: bool):
    out.mkdir()
    args = [str(SCRIPT), info.spec, str(out), "--workers", str(WORKERS)]
    if distributed:
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS)]
        args = [*launcher, *args, "--distributed"]
    proc = run_bounded(
        [sys.executable, *args], cwd=out, env=environment(torchdata), timeout=TIMEOUT
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-5000:]}"
    ranks = RANKS if distributed else 1
    assert sorted(p.name for p in out.iterdir()) == [f"rank{r}.json" for r in range(ranks)]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def test_dataloader2_workers_each_stream_their_slot(torchdata_09, uneven_dataset, tmp_path):
    (record,) = run_check(torchdata_09, uneven_dataset, tmp_path / "out", distributed=False)
    epochs = check_rank(uneven_dataset, record, 0, 1)
    for keys in epochs:
        assert_exactly_once(keys, uneven_dataset.keys)
    assert epochs[0] != epochs[1]


def test_dataloader2_ranks_and_workers_each_stream_their_slot(
    torchdata_09, uneven_dataset, tmp_path
):
    records = run_check(torchdata_09, uneven_dataset, tmp_path / "out", distributed=True)
    per_rank = [check_rank(uneven_dataset, rec, r, RANKS) for r, rec in enumerate(records)]
    for epoch in range(EPOCHS):
        keys = [k for rank in per_rank for k in rank[epoch]]
        assert len(per_rank[0][epoch]) == len(per_rank[1][epoch])  # equal ranks
        assert_exactly_once(keys, set(keys))
        assert len(keys) == len(uneven_dataset.keys) // RANKS * RANKS


def test_apply_sharding_sets_the_slot_and_refuses_a_bad_one(uneven_dataset):
    pipe = StreamingPipe(shardstream.StreamingDataset(uneven_dataset.spec, seed=SEED))
    pipe.apply_sharding(2, 1, SHARDING_PRIORITIES.DISTRIBUTED)
    pipe.apply_sharding(3, 2, SHARDING_PRIORITIES.MULTIPROCESSING)
    ds = pipe.dataset
    assert ds.distributed_slot() == (1, 2) and ds.worker_slot() == (2, 3)
    with pytest.raises(ValueError, match="instance_id"):
        pipe.apply_sharding(2, 2, SHARDING_PRIORITIES.DISTRIBUTED)
    with pytest.raises(TypeError, match="StreamingDataset"):
        StreamingPipe([1, 2, 3])  # type: ignore[arg-type]


def test_several_ranks_without_sample_counts_are_refused_when_sharded(tmp_path, uneven_dataset):
    ds = shardstream.StreamingDataset(f"{uneven_dataset.spec}", manifest=False, count_samples=False)
    with pytest.raises(shardstream.DatasetSpecError, match="shardstream index"):
        StreamingPipe(ds).apply_sharding(2, 0, SHARDING_PRIORITIES.DISTRIBUTED)

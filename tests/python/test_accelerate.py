"""Hugging Face Accelerate and the HF Trainer, for real: two CPU ranks under
torchrun (gloo), the real ``accelerate`` and ``transformers`` packages, a
tiny model built from a config (no weights downloaded).

Before ``shardstream.accelerate``, ``accelerator.prepare(loader)`` trained on
half the data: the default ``DataLoaderDispatcher`` iterates rank 0's part
only, ``dispatch_batches=False`` wraps each rank's part in
``IterableDatasetShard``, which keeps half of it again."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from _shardtest import EXAMPLES_DIR, assert_verified, run_bounded

import shardstream

NPROC = 2
LAUNCH_TIMEOUT = 240


def torchrun(script: str, args: list[str], cwd: Path) -> tuple[int, str, str]:
    """``examples/<script>`` under torchrun with two ranks; the launch is
    killed with its process group past ``LAUNCH_TIMEOUT``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", str(NPROC), str(EXAMPLES_DIR / script), *args]
    proc = run_bounded(command, cwd=cwd, env=env, timeout=LAUNCH_TIMEOUT)
    return proc.returncode, proc.stdout, proc.stderr


def records(out: Path) -> list[dict]:
    assert sorted(out.glob("rank-*.json")) == [out / f"rank-{r}.json" for r in range(NPROC)]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(NPROC)]


def run_ok(script: str, args: list[str], cwd: Path, out: Path) -> list[dict]:
    rc, stdout, stderr = torchrun(script, [*args, "--out", str(out)], cwd)
    assert rc == 0, f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-6000:]}"
    return records(out)


@pytest.mark.timeout(900)  # several launched jobs, each bounded; `make test` shares the cores
def test_accelerate_loop_gives_every_sample_once_per_epoch_and_resumes_exactly(dataset, tmp_path):
    """``prepare_loader``: both epochs hold every sample once, the ranks run
    equal batches; ``save_state`` after 5 batches and ``load_state`` in a
    new job give each rank exactly the rest of the uninterrupted run. Each
    job writes its ledger (``prepare_loader(ledger_dir=...)``), which
    ``shardstream verify`` proves, the resumed one's across both runs."""
    ledger = ["--ledger", str(tmp_path / "ledger-full")]
    full = run_ok("accelerate_train.py", [dataset.spec, *ledger], tmp_path, tmp_path / "full")
    assert_verified(tmp_path / "ledger-full", epochs=2)
    for epoch in (0, 1):
        per_rank = [r["epochs"][epoch]["keys"] for r in full]
        assert [r["epochs"][epoch]["epoch"] for r in full] == [epoch, epoch]
        union = per_rank[0] + per_rank[1]
        assert sorted(union) == sorted(dataset.keys), f"epoch {epoch} lost or repeated samples"
        batches = [r["epochs"][epoch]["batches"] for r in full]
        assert batches[0] == batches[1] > 0
    checkpoint = tmp_path / "ckpt"
    ledger = ["--ledger", str(tmp_path / "ledger")]
    stop = ["--stop-after", "5", "--checkpoint", str(checkpoint), *ledger]
    stopped = run_ok("accelerate_train.py", [dataset.spec, *stop], tmp_path, tmp_path / "a")
    resume = ["--resume", str(checkpoint), *ledger]
    resumed = run_ok("accelerate_train.py", [dataset.spec, *resume], tmp_path, tmp_path / "b")
    assert_verified(tmp_path / "ledger", epochs=2)
    for rank in range(NPROC):
        head = stopped[rank]["epochs"][0]["keys"]
        assert stopped[rank]["epochs"][0]["batches"] == 5
        tail = resumed[rank]["epochs"][0]["keys"]
        assert head + tail == full[rank]["epochs"][0]["keys"], f"rank {rank}"
        assert resumed[rank]["epochs"][1] == full[rank]["epochs"][1], f"rank {rank}"


@pytest.mark.parametrize(
    ("flags", "wrapper"),
    [
        ([], "DataLoaderDispatcher"),
        (["--no-dispatch-batches"], "IterableDatasetShard"),
        (["--stateless", "--num-workers", "0"], "DataLoaderDispatcher"),
    ],
    ids=["dispatch", "iterable-dataset-shard", "plain-dataloader"],
)
def test_accelerator_prepare_of_the_loader_raises_naming_the_fix(dataset, tmp_path, flags, wrapper):
    """The standard ``accelerator.prepare(model, optimizer, loader)``: every
    rank fails at its first batch with ``FrameworkWrapperError`` naming
    Accelerate's wrapper and ``prepare_loader``, instead of training on half
    of the data."""
    out = tmp_path / "out"
    args = [dataset.spec, "--plain-prepare", *flags, "--out", str(out)]
    rc, stdout, stderr = torchrun("accelerate_train.py", args, tmp_path)
    assert rc != 0, stdout
    assert not out.exists() or not list(out.iterdir()), "a rank finished an epoch"
    for rank in range(NPROC):
        lines = [line for line in stderr.splitlines() if line.startswith(f"[rank{rank}]:")]
        message = "\n".join(lines)
        assert "shardstream.resplit.FrameworkWrapperError" in message, stderr[-5000:]
        assert f"accelerate's {wrapper} wraps this StreamingDataset" in message
        assert "shardstream.accelerate.prepare_loader(accelerator, loader)" in message
    assert issubclass(shardstream.FrameworkWrapperError, shardstream.ShardStreamError)


def test_hf_trainer_recipe_trains_on_every_sample_once_per_epoch(dataset, tmp_path):
    """``examples/hf_trainer_speech.py``: a tiny Wav2Vec2 classifier on the
    WAV shards with ``shardstream.transformers.StreamingTrainer``; each
    epoch the ranks train on disjoint halves that make up the whole
    dataset, in the same number of steps, and the ledger the Trainer
    writes verifies."""
    out = tmp_path / "out"
    ledger = ["--ledger", str(tmp_path / "ledger")]
    full = run_ok("hf_trainer_speech.py", [dataset.spec, *ledger], tmp_path, out)
    assert_verified(tmp_path / "ledger", epochs=2)
    assert full[0]["steps"] == full[1]["steps"] > 0
    for epoch in ("0", "1"):
        per_rank = [r["epochs"][epoch] for r in full]
        assert len(per_rank[0]) == len(per_rank[1])
        assert sorted(per_rank[0] + per_rank[1]) == sorted(dataset.keys), f"epoch {epoch}"


def test_hf_trainer_without_the_recipe_raises_naming_the_fix(dataset, tmp_path):
    """``transformers.Trainer`` as it is, with the dataset as
    ``train_dataset``: ``FrameworkWrapperError`` on every rank at the first
    batch, naming the override, instead of training on half of the data."""
    out = tmp_path / "out"
    args = [dataset.spec, "--plain-trainer", "--out", str(out)]
    rc, stdout, stderr = torchrun("hf_trainer_speech.py", args, tmp_path)
    assert rc != 0, stdout
    assert not out.exists() or not list(out.glob("rank-*.json"))
    for rank in range(NPROC):
        lines = [line for line in stderr.splitlines() if line.startswith(f"[rank{rank}]:")]
        message = "\n".join(lines)
        assert "shardstream.resplit.FrameworkWrapperError" in message, stderr[-5000:]
        assert "with the HF Trainer, use shardstream.transformers.StreamingTrainer" in message


@pytest.mark.parametrize("mixed", [False, True], ids=["dataset", "mix"])
def test_accelerates_iterable_dataset_shard_over_a_split_dataset_is_refused(dataset, mixed):
    """The check runs in the process itself, with Accelerate's own
    ``IterableDatasetShard``: a ``Mix`` of split datasets is refused as a
    ``StreamingDataset`` is, and one rank's data is let be."""
    from accelerate.data_loader import IterableDatasetShard

    def data(world_size: int):
        streams = [
            shardstream.StreamingDataset(dataset.spec, world_size=world_size, rank=0, seed=s)
            for s in (0, 1)
        ]
        return shardstream.Mix(streams, [1, 1]) if mixed else streams[0]

    split = data(2)
    wrapped = IterableDatasetShard(split, batch_size=2, num_processes=2, process_index=0)
    name = type(split).__name__
    with pytest.raises(shardstream.FrameworkWrapperError, match=f"wraps this {name}"):
        next(iter(wrapped))
    whole = IterableDatasetShard(data(1), batch_size=2, num_processes=1, process_index=0)
    assert next(iter(whole))["__key__"]


@pytest.mark.parametrize("mixed", [False, True], ids=["dataset", "mix"])
def test_the_dispatcher_over_spawned_workers_is_refused(dataset, mixed):
    """A worker started with spawn has no frame of Accelerate's
    ``DataLoaderDispatcher`` on its stack: the wrapper is named when the
    dataset is pickled for it, in the process the dispatcher runs in."""
    from accelerate import PartialState
    from accelerate.data_loader import DataLoaderDispatcher

    PartialState()
    streams = [
        shardstream.StreamingDataset(dataset.spec, world_size=2, rank=0, seed=s) for s in (0, 1)
    ]
    data = shardstream.Mix(streams, [1, 1]) if mixed else streams[0]
    loader = DataLoaderDispatcher(
        data, batch_size=None, num_workers=1, multiprocessing_context="spawn", timeout=120
    )
    name = type(data).__name__
    with pytest.raises(
        shardstream.FrameworkWrapperError, match=f"DataLoaderDispatcher wraps this {name}"
    ):
        next(iter(loader))


ONE_PROCESS_ACCELERATOR = """
import sys

from accelerate import Accelerator
from torch.utils.data import DataLoader

import shardstream
from shardstream.accelerate import prepare_loader

accelerator = Accelerator()  # no cpu=True
loader = DataLoader(shardstream.StreamingDataset(sys.argv[1]), batch_size=4)
try:
    prepare_loader(accelerator, loader)
except shardstream.FrameworkWrapperError as error:
    # One write per line: print() writes the text and its newline apart,
    # so the two ranks' lines could interleave into one on the shared pipe.
    sys.stdout.write(f"refused: {error}\\n")
    sys.stdout.flush()
    sys.exit(3)
print("prepared", flush=True)
"""


def test_an_accelerator_without_cpu_under_torchrun_on_cpu_is_refused(dataset, tmp_path):
    """torchrun on a machine without GPUs and ``Accelerator()`` without
    ``cpu=True``: Accelerate joins torch.distributed's group of 2 but counts
    one process on each rank, so each would train a model of its own on its
    part of the data. ``prepare_loader`` refuses it at once on every rank,
    naming the fix."""
    script = tmp_path / "one_process_accelerator.py"
    script.write_text(ONE_PROCESS_ACCELERATOR)
    rc, stdout, stderr = torchrun(str(script), [dataset.spec], tmp_path)
    assert rc != 0, stdout
    refusals = [line for line in stdout.splitlines() if line.startswith("refused: ")]
    assert len(refusals) == NPROC, f"stdout:\n{stdout}\nstderr:\n{stderr[-5000:]}"
    message = refusals[0]
    assert "accelerator.num_processes is 1 but the job has 2 processes" in message, message
    assert "torch.distributed's world size" in message, message
    assert "Accelerator(cpu=True)" in message and "accelerate launch" in message, message


def test_an_accelerator_of_one_process_under_a_world_size_of_two_is_refused(dataset, monkeypatch):
    """Without torch.distributed, the ``WORLD_SIZE`` a launcher sets is the
    job's size the dataset sees: an Accelerator of one process beside a
    ``WORLD_SIZE`` of 2 is refused as well."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch.utils.data import DataLoader

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator()
        assert accelerator.num_processes == 1
        data = shardstream.StreamingDataset(dataset.spec, count_samples=True)
        loader = DataLoader(data, batch_size=4)
        with pytest.raises(shardstream.FrameworkWrapperError) as raised:
            shardstream.accelerate.prepare_loader(accelerator, loader)
        message = str(raised.value)
        assert "num_processes is 1" in message and "WORLD_SIZE=2" in message, message
        assert "Accelerator(cpu=True)" in message and "accelerate launch" in message, message
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("stateful", [False, True], ids=["dataloader", "stateful"])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("mixed", [False, True], ids=["dataset", "mix"])
def test_a_pass_left_early_then_the_epochs_accelerate_counts(dataset, mixed, num_workers, stateful):
    """Accelerate counts an epoch only when a pass ends, and sets the epoch
    it counts at each new pass: after a pass left early (``break``) it
    sets that epoch again. Each later pass streams the epoch Accelerate
    set, whole, in the main process as in DataLoader workers. Before, in
    the main process the iterator left was taken for the one in progress:
    the pass after it streamed epoch 1 and the next one epoch 1 again."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState
    from torch.utils.data import DataLoader

    def ids(samples):
        return [tuple(int(v) for v in s["__id__"]) for s in samples]

    def data():
        streams = [
            shardstream.StreamingDataset(dataset.spec, seed=s, sample_ids=True) for s in (0, 1)
        ]
        return shardstream.Mix(streams, [1, 1], policy="stop") if mixed else streams[0]

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        config = DataLoaderConfiguration(use_stateful_dataloader=stateful)
        accelerator = Accelerator(cpu=True, dataloader_config=config)
        loader = shardstream.accelerate.prepare_loader(
            accelerator, DataLoader(data(), batch_size=4, num_workers=num_workers, collate_fn=ids)
        )
        for i, _ in enumerate(loader):
            if i == 1:
                break
        for epoch in range(3):
            assert loader.iteration == epoch
            got = [sample for batch in loader for sample in batch]
            expected = data()
            expected.set_epoch(epoch)
            whole = [
                s
                for batch in DataLoader(
                    expected, batch_size=4, num_workers=num_workers, collate_fn=ids
                )
                for s in batch
            ]
            assert got == whole, f"pass of epoch {epoch}"
            assert {e for e, _, _ in got} == {epoch}
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)

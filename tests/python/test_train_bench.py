"""The training benchmark (benches/train_bench.py) runs end to end, on the
CPU at a tiny size: every pipeline trains the steps it was asked for, and
only a library that is truly missing is reported as not installed. Speed is
not checked here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benches" / "train_bench.py"
LIBRARIES = {"webdataset + PIL": "webdataset", "litdata + PIL": "litdata"}


def launch(script: Path, *args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    """`script` run with `args` by this interpreter, its output captured."""
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.timeout(900)  # several launched jobs, each bounded; `make test` shares the cores
def test_every_pipeline_trains_the_steps_asked_for(tmp_path):
    batch, steps = 4, 2
    sizes = ("--batch", str(batch), "--steps", str(steps), "--warmup", "1")
    data = ("--shards", "2", "--per-shard", "8")
    run = ("--out", str(tmp_path), "--device", "cpu", "--models", "resnet18", "--workers", "2")
    out = launch(BENCH, *run, *sizes, *data, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = json.loads((tmp_path / "train_bench.json").read_text())
    assert [r["pipeline"] for r in rows] == [
        "ceiling",
        "shardstream Image",
        "shardstream GPU decode",
        "shardstream + PIL",
        "webdataset + PIL",
        "litdata + PIL",
    ]
    for row in rows:
        module = LIBRARIES.get(row["pipeline"])
        if module is not None and importlib.util.find_spec(module) is None:
            assert row["error"] == "not installed", row
            continue
        assert "error" not in row, row
        assert row["images"] == batch * steps, row
        assert row["images_per_s"] > 0 and row["cpu_ms_per_image"] > 0, row
        assert 0 < row["cores_busy"] <= (os.cpu_count() or 1) + 0.5, row
        # The machine's busy time holds the workers' (within a clock tick
        # per image of the two counters' rounding).
        tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
        assert 0 <= row["worker_cpu_ms_per_image"] <= row["cpu_ms_per_image"] + tick_ms, row
    assert "| resnet18 | 2 | shardstream Image |" in out.stdout


@pytest.mark.timeout(600)
def test_no_model_times_each_step_and_the_decode_profile_runs(tmp_path):
    """``--models none`` trains nothing and reports each step's median and
    slowest time; ``gpu_decode_profile.py`` times each stage of the
    batched decode and a step beside its thread (here on the CPU)."""
    sizes = ("--batch", "4", "--steps", "3", "--warmup", "1", "--shards", "2", "--per-shard", "8")
    run = ("--out", str(tmp_path), "--device", "cpu", "--models", "none", "--workers", "0")
    pipelines = ("--pipelines", "shardstream GPU decode")
    out = launch(BENCH, *run, *sizes, *pipelines, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    (row,) = json.loads((tmp_path / "train_bench.json").read_text())
    assert row["model"] == "none" and row["images"] == 12, row
    assert 0 < row["median_step_seconds"] <= row["slowest_step_seconds"], row
    profile = BENCH.parent / "gpu_decode_profile.py"
    args = ("--data", str(tmp_path / "train-data"), "--device", "cpu", "--batch", "4")
    args += ("--steps", "1", "--reps", "1", "--models", "resnet18")
    out = launch(profile, *args, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    for stage in ("decode_jpeg on the list", "augment (pad", "the whole decoder call"):
        assert f"{stage}" in out.stdout, out.stdout
    assert out.stdout.count("resnet18 step beside") == 4, out.stdout


def test_without_a_cuda_device_it_refuses_rather_than_measure_the_cpu(tmp_path):
    # No device is visible to the run, whatever this machine has.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, str(BENCH), "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode != 0
    assert "no CUDA device" in out.stderr
    assert not (tmp_path / "train-data").exists()


BUSY = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"


def load_bench():
    spec = importlib.util.spec_from_file_location("train_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_cpu_time_counts_workers_that_ended():
    """Workers retired at an epoch's end (waited for, so gone from /proc)
    still count: the figure never falls (it went negative across epochs)."""
    bench = load_bench()
    own_before, before = bench.tree_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", BUSY])
    readings = []
    while child.poll() is None:
        readings.append(bench.tree_cpu_seconds()[1])
        time.sleep(0.05)
    child.wait(timeout=30)
    own_after, after = bench.tree_cpu_seconds()
    assert after - before >= 0.4, (before, after)
    pairs = zip([before, *readings], [*readings, after], strict=True)
    assert all(earlier <= later + 0.02 for earlier, later in pairs), readings
    assert own_after - own_before < after - before


def test_the_machine_busy_time_sees_a_known_busy_loop():
    """/proc/stat's busy time over a window holds a loop known to take 0.5
    CPU seconds (other work on the machine only adds to it), and no more
    than every core busy for the window."""
    bench = load_bench()
    start, wall = bench.machine_busy_seconds(), time.perf_counter()
    exec(BUSY, {})
    busy, wall = bench.machine_busy_seconds() - start, time.perf_counter() - wall
    assert 0.45 <= busy <= wall * (os.cpu_count() or 1) + 0.05, (busy, wall)


def test_cpu_time_counts_live_workers(tmp_path):
    # DataLoader workers are alive while a run is measured, so RUSAGE_CHILDREN
    # (waited-for children only) would miss their time.
    bench = load_bench()
    busy = BUSY
    done = tmp_path / "done"
    child = subprocess.Popen(
        [sys.executable, "-c", busy + f"open({str(done)!r}, 'w').close()\ntime.sleep(60)"]
    )
    try:
        own_before, _ = bench.tree_cpu_seconds()
        for _ in range(300):
            if done.exists() or child.poll() is not None:
                break
            time.sleep(0.1)
        assert done.exists()
        own_after, workers = bench.tree_cpu_seconds()
        assert workers >= 0.4, workers
        assert own_after - own_before < workers
    finally:
        child.kill()
        child.wait(timeout=30)

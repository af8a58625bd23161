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


@pytest.mark.timeout(900)  # several launched jobs, each bounded; `make test` shares the cores
def test_every_pipeline_trains_the_steps_asked_for(tmp_path):
    batch, steps = 4, 2
    sizes = ("--batch", str(batch), "--steps", str(steps), "--warmup", "1")
    data = ("--shards", "2", "--per-shard", "8")
    run = ("--out", str(tmp_path), "--device", "cpu", "--models", "resnet18", "--workers", "2")
    out = subprocess.run(
        [sys.executable, str(BENCH), *run, *sizes, *data],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
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
        assert 0 <= row["worker_cpu_ms_per_image"] <= row["cpu_ms_per_image"], row
    assert "| resnet18 | 2 | shardstream Image |" in out.stdout


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


def test_cpu_time_counts_live_workers(tmp_path):
    # DataLoader workers are alive while a run is measured, so RUSAGE_CHILDREN
    # (waited-for children only) would miss their time.
    spec = importlib.util.spec_from_file_location("train_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    busy = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"
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

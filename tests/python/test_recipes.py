"""The recipes of the docs, run as written: each code block marked
``<!-- recipe: NAME -->`` in docs/*.md is taken from the page (not copied
here), its dataset placeholder (``SHARDS = "..."``) pointed at a generated
dataset, and run the way the page says, on the CPU."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from _shardtest import REPO_ROOT, run_bounded

DOCS = REPO_ROOT / "docs"
MARKER = re.compile(r"<!-- recipe: (\S+)[^>]*-->\s*```python\n(.*?)```", re.DOTALL)
PLACEHOLDER = re.compile(r'^SHARDS = "[^"]*"', re.MULTILINE)


def recipes() -> dict[str, str]:
    """Every marked recipe of the docs, by name."""
    found: dict[str, str] = {}
    for page in sorted(DOCS.glob("*.md")):
        for name, code in MARKER.findall(page.read_text()):
            assert name not in found, f"recipe {name} marked twice"
            found[name] = code
    return found


def runnable(name: str, spec: str, directory: Path) -> Path:
    """The recipe as a script reading ``spec``."""
    code = recipes()[name]
    assert len(PLACEHOLDER.findall(code)) == 1, f"recipe {name} has no SHARDS = line"
    script = directory / f"recipe_{name}.py"  # not the name of a package
    script.write_text(PLACEHOLDER.sub(f"SHARDS = {spec!r}", code))
    return script


def test_the_recipes_are_found():
    assert "accelerate" in recipes()


@pytest.mark.timeout(600)  # a launched job of 2 ranks; `make test` shares the cores
def test_the_accelerate_recipe_runs_on_two_cpu_ranks(dataset, tmp_path):
    """The Accelerate recipe as docs/integrations.md gives it, under torchrun
    on 2 CPU ranks: every sample once per epoch, as many on each rank."""
    script = runnable("accelerate", dataset.spec, tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "2", str(script)]
    done = run_bounded(command, cwd=tmp_path, env=env, timeout=480)
    assert done.returncode == 0, done.stderr[-6000:]
    counts = {
        (int(rank), int(epoch)): int(samples)
        for rank, epoch, samples in re.findall(
            r"rank (\d+) epoch (\d+): (\d+) samples", done.stdout
        )
    }
    assert sorted(counts) == [(0, 0), (0, 1), (1, 0), (1, 1)], done.stdout
    for epoch in (0, 1):
        assert counts[0, epoch] == counts[1, epoch] == len(dataset.keys) // 2, counts


@pytest.mark.timeout(600)  # Grain starts 2 processes; `make test` shares the cores
def test_the_grain_recipe_reads_each_epoch_and_resumes(dataset, tmp_path):
    """The Grain recipe as docs/integrations.md gives it: every sample in
    each epoch, and the checkpoint of step 1 resumes to the rest."""
    script = runnable("grain", dataset.spec, tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    done = run_bounded([sys.executable, str(script)], cwd=tmp_path, env=env, timeout=480)
    assert done.returncode == 0, done.stderr[-6000:]
    total = len(dataset.keys)
    assert f"epoch 0: {total} samples" in done.stdout, done.stdout
    assert f"epoch 1: {total} samples" in done.stdout, done.stdout
    found = re.search(r"resumed: (\d+) samples after the (\d+) of steps", done.stdout)
    assert found, done.stdout
    rest, trained = int(found.group(1)), int(found.group(2))
    assert 0 < trained <= 64 and rest + trained == total, done.stdout

"""DataLoader workers started with spawn or forkserver: what would make them
fail or hang is a ``WorkerStartError`` in the main process, before any
worker starts, naming the fix. A script without ``if __name__ ==
"__main__":`` (each worker imports it again), a ``collate_fn`` or
``worker_init_fn`` that cannot be pickled."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _shardtest import keys_of
from torch.utils.data import DataLoader

from shardstream import Mix, StreamingDataset, WorkerStartError

SCRIPT_BODY = """\
ds = StreamingDataset({spec!r}, seed=1)
loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context={method!r},
                    collate_fn=keys)
seen = [key for batch in loader for key in batch]
print(len(seen), len(set(seen)))
"""


def write_script(path: Path, spec: str, method: str, guarded: bool) -> Path:
    body = SCRIPT_BODY.format(spec=spec, method=method)
    if guarded:
        body = 'if __name__ == "__main__":\n' + textwrap.indent(body, "    ")
    header = (
        "from torch.utils.data import DataLoader\n"
        "from shardstream import StreamingDataset\n\n\n"
        "def keys(batch):\n"
        '    return [s["__key__"] for s in batch]\n\n\n'
    )
    path.write_text(header + body)
    return path


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_script_without_the_main_guard_is_refused_before_its_workers_start(
    dataset, tmp_path, method
):
    script = write_script(tmp_path / "train.py", dataset.spec, method, guarded=False)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode != 0
    assert "WorkerStartError" in done.stderr, done.stderr[-3000:]
    assert 'if __name__ == "__main__":' in done.stderr
    assert f"{script}" in done.stderr and "line 12" in done.stderr, done.stderr[-3000:]
    # Refused in the main process: no worker ran the script again.
    assert "bootstrapping phase" not in done.stderr


def test_the_same_script_under_the_guard_reads_every_sample_once(dataset, tmp_path):
    script = write_script(tmp_path / "train.py", dataset.spec, "spawn", guarded=True)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    total = len(dataset.keys)
    assert done.stdout.split() == [str(total), str(total)]


def identity(batch):
    return batch


@pytest.mark.parametrize("mixed", [False, True], ids=["dataset", "mix"])
@pytest.mark.parametrize("function", ["collate_fn", "worker_init_fn"])
def test_an_unpicklable_loader_function_is_named_before_spawn_workers_start(
    dataset, function, mixed
):
    ds = StreamingDataset(dataset.spec, seed=1)
    source = Mix([ds, StreamingDataset(dataset.spec, seed=2)], weights=[1, 1]) if mixed else ds
    kwargs = {"collate_fn": identity, function: lambda *args: args[0] if args else None}
    loader = DataLoader(
        source, batch_size=2, num_workers=1, multiprocessing_context="spawn", **kwargs
    )
    with pytest.raises(WorkerStartError, match=rf"the DataLoader's {function} .*lambda"):
        next(iter(loader))
    # With module-level functions the same loader starts and reads.
    loader = DataLoader(
        ds, batch_size=2, num_workers=1, multiprocessing_context="spawn", collate_fn=identity
    )
    assert len(keys_of([s for batch in loader for s in batch])) == len(dataset.keys)

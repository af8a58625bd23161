"""``examples/ddp_torchrun.py`` under torchrun on loopback (gloo): 1 node x 2
processes and 2 nodes x 2 processes, 2 DataLoader workers per rank, shards of
very uneven sizes with a manifest. DDP all-reduces gradients every step, so
unequal batch counts would hang: every launch runs under a timeout that
kills its whole process group."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections import Counter

import pytest
from _shardtest import (
    EXAMPLES_DIR,
    UNEVEN_COUNTS,
    epoch_sequence,
    free_port,
    kill_launch,
    stacks,
)

LAUNCH_TIMEOUT = 240
NPROC = 2
WORKERS = 2
BATCH = 4
SEED = 7


def launch_nodes(nnodes: int, args: list[str], cwd) -> list[subprocess.CompletedProcess[str]]:
    """Starts ``nnodes`` torchrun agents (static rendezvous on 127.0.0.1),
    each in its own process group, and waits for all of them; on timeout
    fails with the stacks of every process, killing every group (agents,
    ranks, DataLoader workers)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    port = free_port()
    commands = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(nnodes),
            "--nproc_per_node",
            str(NPROC),
            "--node_rank",
            str(node),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            str(EXAMPLES_DIR / "ddp_torchrun.py"),
            *args,
        ]
        for node in range(nnodes)
    ]
    # Output to files, not pipes: no agent can block on a full pipe while
    # the test waits for another.
    logs = [(cwd / f"node-{node}.out", cwd / f"node-{node}.err") for node in range(nnodes)]
    procs = []
    for command, (out, err) in zip(commands, logs, strict=True):
        with open(out, "w") as stdout, open(err, "w") as stderr:
            procs.append(
                subprocess.Popen(
                    command,
                    cwd=cwd,
                    env=env,
                    stdout=stdout,
                    stderr=stderr,
                    text=True,
                    start_new_session=True,
                )
            )

    def result(node: int) -> subprocess.CompletedProcess[str]:
        out, err = logs[node]
        proc = procs[node]
        return subprocess.CompletedProcess(
            commands[node], proc.returncode, out.read_text(), err.read_text()
        )

    deadline = time.monotonic() + LAUNCH_TIMEOUT
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        # Where every process (agents, ranks, workers) waited, then kill them.
        waits = [stacks(proc.pid) for proc in procs]
        for proc in procs:
            kill_launch(proc)
        outputs = [
            f"node {node} stdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-2000:]}"
            for node, r in enumerate(map(result, range(nnodes)))
        ]
        pytest.fail(
            f"torchrun did not finish within {LAUNCH_TIMEOUT} s (a rank hung?)\n"
            + "\n".join(outputs)
            + "\nstacks:\n"
            + "\n".join(waits)
        )
    return [result(node) for node in range(nnodes)]


def expected_batches(per_rank: int) -> int:
    """Batches of one rank: its samples split over the workers (the first
    ``per_rank % WORKERS`` get one more), each worker batching its own."""
    shares = [per_rank // WORKERS + (w < per_rank % WORKERS) for w in range(WORKERS)]
    return sum(math.ceil(share / BATCH) for share in shares)


@pytest.mark.parametrize(
    ("nnodes", "remainder", "epochs"),
    [(1, "drop", 2), (2, "drop", 1), (2, "pad", 1)],
    ids=["1x2-drop", "2x2-drop", "2x2-pad"],
)
def test_ddp_ranks_get_equal_batches(uneven_dataset, tmp_path, nnodes, remainder, epochs):
    out = tmp_path / "out"
    args = [str(uneven_dataset.root), "--out", str(out), "--batch-size", str(BATCH)]
    args += ["--num-workers", str(WORKERS), "--epochs", str(epochs)]
    args += ["--remainder", remainder, "--seed", str(SEED)]
    nodes = launch_nodes(nnodes, args, tmp_path)
    for node, proc in enumerate(nodes):
        assert proc.returncode == 0, (
            f"node {node}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
        )
    assert "ok: " in nodes[0].stdout

    world_size = nnodes * NPROC
    total = sum(UNEVEN_COUNTS)
    per_rank = total // world_size if remainder == "drop" else math.ceil(total / world_size)
    assert sorted(p.name for p in out.iterdir()) == [f"rank-{r}.json" for r in range(world_size)]
    records = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world_size)]
    for rank, record in enumerate(records):
        assert record["rank"] == rank
        assert record["world_size"] == world_size
        assert record["local_rank"] == rank % NPROC
        assert record["samples_per_rank"] == per_rank
        assert [e["epoch"] for e in record["epochs"]] == list(range(epochs))

    orders = []
    for epoch in range(epochs):
        runs = [record["epochs"][epoch] for record in records]
        # Equal batch counts (drop_last=False), as every rank saw in the all-reduce.
        assert [run["batches"] for run in runs] == [expected_batches(per_rank)] * world_size
        assert all(run["min_batches"] == run["max_batches"] == run["batches"] for run in runs)
        keys = [run["keys"] for run in runs]
        assert [len(k) for k in keys] == [per_rank] * world_size
        every = [key for rank_keys in keys for key in rank_keys]
        counts = Counter(every)
        if remainder == "drop":
            # Disjoint, and together the epoch sequence without its tail.
            assert len(counts) == len(every) == per_rank * world_size
            sequence = epoch_sequence(uneven_dataset, seed=SEED, epoch=epoch)
            assert set(every) == set(sequence[: per_rank * world_size])
            assert len(sequence) - len(every) == total % world_size
        else:
            assert set(counts) == set(uneven_dataset.keys)
            assert sum(n - 1 for n in counts.values()) == per_rank * world_size - total
        orders.append(keys)
    if epochs > 1:
        assert orders[0] != orders[1]

"""Iterators used across a fork, and how samples pickle in a DataLoader
worker."""

from __future__ import annotations

import os
import pickle
import select
import signal
import time
from multiprocessing.reduction import ForkingPickler

from _shardtest import collect, keys_of, write_tar
from torch.utils.data import DataLoader

import shardstream
from shardstream import StreamProcessError

SEED = 9

# --------------------------------------------------------------------------
# An iterator used in a forked child
# --------------------------------------------------------------------------


def test_an_iterator_started_in_the_parent_raises_in_a_forked_child(dataset):
    ds = shardstream.StreamingDataset(dataset.spec, seed=SEED)
    iterator = iter(ds)
    next(iterator)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what next() does, then leave at once
        try:
            os.close(read)
            try:
                next(iterator)
                message = "no error"
            except BaseException as error:
                message = f"{type(error).__name__}: {error}"
            os.write(write, message.encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 30)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        message = os.read(read, 4096).decode() if ready else "the child hung"
    finally:
        os.close(read)
        deadline = time.monotonic() + 10
        while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert message == (
        f"StreamProcessError: this stream was started in process {os.getpid()}; "
        "create a new iterator in this process"
    )
    assert issubclass(StreamProcessError, shardstream.ShardStreamError)
    # The parent's iterator goes on.
    assert len(keys_of(iterator)) == len(dataset.keys) - 1


# --------------------------------------------------------------------------
# Samples pickled in a DataLoader worker
# --------------------------------------------------------------------------


def pickle_in_worker(samples):
    """A DataLoader collate function (it runs in the worker): how each
    sample's long field pickles there."""
    out = []
    for sample in samples:
        value = sample["bin"]
        plain = pickle.dumps(value)
        out.append(
            {
                "key": sample["__key__"],
                "type": type(value).__name__,
                "length": len(value),
                "plain": len(plain),
                "round_trip": pickle.loads(plain) == value,
                "forking": len(bytes(ForkingPickler.dumps(value))),
            }
        )
    return out


def test_a_sample_pickled_in_a_worker_holds_its_bytes(tmp_path):
    members = []
    for i in range(4):
        members.append((f"k{i}.bin", bytes([i]) * 50_000))
        members.append((f"k{i}.txt", b"x"))
    path = write_tar(tmp_path / "shard.tar", members)
    ds = shardstream.StreamingDataset(str(path), shuffle_buffer=0)
    dl = DataLoader(ds, batch_size=2, num_workers=1, collate_fn=pickle_in_worker, timeout=120)
    rows = [row for batch in collect(dl) for row in batch]
    assert len(rows) == 4
    for row in rows:
        assert row["type"] == "LocalBytes" and row["length"] == 50_000
        assert row["plain"] >= 50_000 and row["round_trip"], row
        # multiprocessing's pickler (the DataLoader's hand-off) still
        # writes the place in the shard.
        assert row["forking"] < 1000, row

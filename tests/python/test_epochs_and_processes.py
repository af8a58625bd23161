"""How samples pickle in a DataLoader worker."""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

from _shardtest import collect, write_tar
from torch.utils.data import DataLoader

import shardstream

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

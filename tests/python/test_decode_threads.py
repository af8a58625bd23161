"""``decode_threads``: how many threads decode and transform each stream's
fields. The samples never depend on it; by default a stream takes the cores
this process may use, shared among its DataLoader workers and torchrun's
processes on the node (``LOCAL_WORLD_SIZE``)."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import numpy as np
import pytest
from _shardtest import collect, loader, write_tar
from PIL import Image as PILImage

from shardstream import Image, StreamingDataset

TASKS = Path("/proc/self/task")
# Helper threads of a decode pool (the name cut to the kernel's 15 bytes).
HELPER = "shardstream-dec"


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> str:
    """Four shards of 48 noisy JPEGs of about 30 KB: any 32 of them are more
    than the 256 KiB a batch needs to be decoded on several threads."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(7)
    for shard in range(4):
        members = []
        for i in range(48):
            pixels = rng.integers(0, 256, (160, 200, 3), dtype=np.uint8)
            buf = io.BytesIO()
            PILImage.fromarray(pixels).save(buf, "JPEG", quality=90)
            assert len(buf.getvalue()) > 16 << 10
            members.append((f"p{shard}-{i:02d}.jpg", buf.getvalue()))
        write_tar(root / f"photos-{shard}.tar", members)
    return str(root / "photos-{0..3}.tar")


def helper_threads() -> int:
    count = 0
    for task in TASKS.iterdir():
        try:
            count += (task / "comm").read_text().strip() == HELPER
        except OSError:
            continue  # the thread ended while we looked
    return count


def pixels(spec: str, **options) -> dict[str, bytes]:
    ds = StreamingDataset(spec, seed=3, decode={"jpg": Image(48, flip=0.5)}, **options)
    return {s["__key__"]: s["jpg"].tobytes() for s in collect(ds)}


def test_the_samples_do_not_depend_on_the_decode_threads(photos):
    one = pixels(photos, decode_threads=1)
    assert len(one) == 192
    assert pixels(photos, decode_threads=5) == one
    assert pixels(photos) == one
    # Nor on the workers, with their own threads each.
    ds = StreamingDataset(photos, seed=3, decode={"jpg": Image(48, flip=0.5)}, decode_threads=2)
    from_workers = {s["__key__"]: np.asarray(s["jpg"]).tobytes() for s in collect(loader(ds, 2))}
    assert from_workers == one


def threads_while_iterating(spec: str, **options) -> int:
    """Helper threads alive while the stream is mid-epoch. The helpers end
    with the stream's pipeline thread, once it has put the epoch's last
    sample out; full-size images (96 KB decoded) fill the stream's output
    queue (a few MiB) long before that, so the thread waits mid-epoch to
    send, however far ahead of this consumer it runs."""
    # An earlier stream's helpers end shortly after it is dropped: wait for
    # them (bounded), so that only this stream's are counted.
    deadline = time.monotonic() + 10
    while helper_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert helper_threads() == 0, "an earlier stream's decode helpers did not end"
    ds = StreamingDataset(spec, shuffle_buffer=0, decode={"jpg": Image(crop=None)}, **options)
    it = iter(ds)
    for _ in range(40):  # past the first batch decoded together
        next(it)
    count = helper_threads()
    del it
    return count


@pytest.mark.parametrize("threads", [1, 3])
def test_decode_threads_sets_the_threads_that_decode(photos, threads):
    assert threads_while_iterating(photos, decode_threads=threads) == threads - 1


def test_by_default_the_cores_are_shared_among_the_nodes_processes(photos, monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert threads_while_iterating(photos) == min(cores, 16) - 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
    assert threads_while_iterating(photos) == 0


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, "invalid option decode_threads: must be at least 1"),
        (-1, ValueError, "invalid option decode_threads: expected a non-negative int"),
        ("4", TypeError, "invalid option decode_threads"),
    ],
)
def test_bad_decode_threads_are_refused_at_construction(photos, value, error, message):
    with pytest.raises(error, match=message):
        StreamingDataset(photos, decode_threads=value)

"""An installed shardstream at work without torch, where it was installed:
shards written by ``ShardWriter``, indexed and planned by the CLI, read back
by the Rust stream that ``StreamingDataset`` iterates, over two ranks, every
sample once and byte for byte. Exits non-zero (an assertion) on any
difference.

Run by ``make test-aarch64`` inside the arm64 root under qemu, and by
tests/python/test_sdist.py in the virtualenv the sdist was built into::

    python build-support/read_check.py DIR MACHINE
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import shardstream
from shardstream import _core

SHARDS = 4
PER_SHARD = 25


def cli(*args: str) -> str:
    """The ``shardstream`` command, run in this process as its entry point
    runs it (under qemu without binfmt_misc an arm64 program cannot start
    another); what it printed. Raises if it fails."""
    with tempfile.TemporaryFile() as out:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(out.fileno(), 1)
        try:
            code = _core.run_cli(["shardstream", *args])
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        out.seek(0)
        printed = out.read().decode()
    assert code == 0, (args, code, printed)
    return printed


def main(root: Path, machine: str) -> None:
    assert platform.machine() == machine, platform.machine()
    root.mkdir(parents=True)
    written = {}
    with shardstream.ShardWriter(str(root / "shard-%06d.tar"), max_count=PER_SHARD) as writer:
        for index in range(SHARDS * PER_SHARD):
            key = f"sample-{index:05d}"
            text = f"aarch64 sample {index}".encode() * (1 + index % 7)
            writer.write({"__key__": key, "txt": text, "cls": str(index % 10).encode()})
            written[key] = text
    spec = str(root / "shard-{000000..000003}.tar")
    manifest = root / "index.json"
    cli("index", spec, "-o", str(manifest))
    counts = [shard["samples"] for shard in json.loads(manifest.read_text())["shards"]]
    assert counts == [PER_SHARD] * SHARDS, counts
    plan = cli("plan", spec, "--world-size", "2")
    assert "rank 1" in plan, plan

    options = _core.Options(seed=3, manifest=str(manifest))
    shards = _core.ShardList([spec], options)
    seen: dict[str, bytes] = {}
    lengths = []
    for rank in range(2):
        stream = _core.SampleStream(shards, epoch=1, world_size=2, rank=rank)
        samples = list(stream)
        lengths.append(len(samples))
        for sample in samples:
            assert sample["__key__"] not in seen, sample["__key__"]
            seen[sample["__key__"]] = bytes(sample["txt"])
    assert lengths == [SHARDS * PER_SHARD // 2] * 2, lengths
    assert seen == written
    print(f"{machine}: {len(seen)} samples over 2 ranks, each once, byte for byte")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])

"""An installed shardstream at work without torch, where it was installed:
shards written by ``ShardWriter``, indexed and planned by the CLI, read back
by the Rust stream that ``StreamingDataset`` iterates, over two ranks, every
sample once and byte for byte; then a JPEG decoded by ``Image`` (the
libjpeg-turbo built into the extension, with this machine's SIMD code) to
the pixels PIL decodes from it. Exits non-zero (an assertion) on any
difference.

Run by ``make test-aarch64`` inside the arm64 root under qemu, and by
tests/python/test_sdist.py in the virtualenv the sdist was built into::

    python build-support/read_check.py DIR MACHINE
"""

from __future__ import annotations

import base64
import hashlib
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

# A 24x16 JPEG (4:2:0, quality 90, written by PIL), and the SHA-256 of the
# RGB pixels PIL decodes from it. libjpeg-turbo's SIMD code (AVX2 on x86-64,
# NEON on aarch64) decodes to the same bytes as its C code on every
# platform, so the digest holds everywhere.
JPEG_BASE64 = (
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAMCAgMCAgMDAwMEAwMEBQgFBQQEBQoHBwYIDAoM"
    "DAsKCwsNDhIQDQ4RDgsLEBYQERMUFRUVDA8XGBYUGBIUFRT/2wBDAQMEBAUEBQkFBQkUDQsN"
    "FBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBT/wAAR"
    "CAAQABgDASIAAhEBAxEB/8QAHwAAAQUBAQEBAQEAAAAAAAAAAAECAwQFBgcICQoL/8QAtRAA"
    "AgEDAwIEAwUFBAQAAAF9AQIDAAQRBRIhMUEGE1FhByJxFDKBkaEII0KxwRVS0fAkM2JyggkK"
    "FhcYGRolJicoKSo0NTY3ODk6Q0RFRkdISUpTVFVWV1hZWmNkZWZnaGlqc3R1dnd4eXqDhIWG"
    "h4iJipKTlJWWl5iZmqKjpKWmp6ipqrKztLW2t7i5usLDxMXGx8jJytLT1NXW19jZ2uHi4+Tl"
    "5ufo6erx8vP09fb3+Pn6/8QAHwEAAwEBAQEBAQEBAQAAAAAAAAECAwQFBgcICQoL/8QAtREA"
    "AgECBAQDBAcFBAQAAQJ3AAECAxEEBSExBhJBUQdhcRMiMoEIFEKRobHBCSMzUvAVYnLRChYk"
    "NOEl8RcYGRomJygpKjU2Nzg5OkNERUZHSElKU1RVVldYWVpjZGVmZ2hpanN0dXZ3eHl6goOE"
    "hYaHiImKkpOUlZaXmJmaoqOkpaanqKmqsrO0tba3uLm6wsPExcbHyMnK0tPU1dbX2Nna4uPk"
    "5ebn6Onq8vP09fb3+Pn6/9oADAMBAAIRAxEAPwD4n8OfCj7v7n9K9Q8O/Cf7v7n9K998OfCf"
    "7v7n9K9Q8O/Cf7v7n9K3y7G7anx/C3H3w++eB+HPhP8Ad/c/pRX2TonwvjtYfNljCRoMliOl"
    "FfU1uKMryzlp47F06UmrpTnGLa2uk2tD+psq46nPDpxbZ//Z"
)
JPEG_PIXELS_SHA256 = "7303a09637d8f93639b09e00debe696b51500ed1b5cf28fe45db8f0c3fcb2749"


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
    check_jpeg(root, machine)


def check_jpeg(root: Path, machine: str) -> None:
    """``JPEG_BASE64`` decoded by ``Image(crop=None)`` to PIL's pixels."""
    with shardstream.ShardWriter(str(root / "image-%06d.tar"), max_count=1) as writer:
        writer.write({"__key__": "image", "jpg": base64.b64decode(JPEG_BASE64)})
    image = shardstream.Image(crop=None, layout="HWC")
    options = _core.Options(decode={"jpg": image})
    shards = _core.ShardList([str(root / "image-000000.tar")], options)
    (sample,) = list(_core.SampleStream(shards, epoch=0, world_size=1, rank=0))
    pixels = sample["jpg"]
    assert pixels.shape == (16, 24, 3), pixels.shape
    digest = hashlib.sha256(pixels.tobytes()).hexdigest()
    assert digest == JPEG_PIXELS_SHA256, digest
    print(f"{machine}: a JPEG decodes to PIL's pixels")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])

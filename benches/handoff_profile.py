"""Where the time of the per-sample hand-off goes at workers 0: samples the
CPU with `perf` while one process iterates 200-byte samples through
`DataLoader(batch_size=32, collate_fn=list)` (the "small" profile of
`make bench-peers`), after its imports and a warm-up epoch, and prints the
share of each library and the top functions.

    python benches/handoff_profile.py --out bench-results [--epochs 8] [--top 40]

Needs `perf` (linux-perf) and permission to sample the child
(`kernel.perf_event_paranoid` <= 1, or root). The shards (8 x 25,000
samples of a 200-byte `.txt` and a `.cls`) are written under
`OUT/handoff-data` the first time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SHARDS, PER_SHARD = 8, 25_000


def make_data(root: Path) -> Path:
    """The small profile's shards under `root`, written once."""
    if (root / "manifest.json").exists():
        return root
    from shardstream import ShardWriter

    root.mkdir(parents=True, exist_ok=True)
    with ShardWriter(str(root / "small-%06d.tar"), max_count=PER_SHARD) as writer:
        for i in range(SHARDS * PER_SHARD):
            payload = bytes([97 + i % 26]) * 200
            writer.write({"__key__": f"s{i:07d}", "txt": payload, "cls": b"%d" % (i % 1000)})
    return root


def iterate(data: Path, epochs: int, ready: Path) -> None:
    """The profiled child: a warm-up epoch, `ready` written, then `epochs`."""
    from torch.utils.data import DataLoader

    from shardstream import StreamingDataset

    dataset = StreamingDataset(str(data), seed=0, shuffle_buffer=1000)
    loader = DataLoader(dataset, batch_size=32, collate_fn=list, num_workers=0)
    dataset.set_epoch(epochs)
    for _ in loader:
        pass
    ready.write_text("ready")
    time.sleep(0.5)
    start, seen = time.perf_counter(), 0
    for epoch in range(epochs):
        dataset.set_epoch(epoch)
        keys: list[str] = []
        for batch in loader:
            keys.extend(sample["__key__"] for sample in batch)
            seen += len(batch)
    print(f"{seen:,} samples, {seen / (time.perf_counter() - start):,.0f} samples/s", flush=True)
    # Ends here, without the interpreter's finalisation (a collection of
    # every object torch made), which would otherwise be in the profile.
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        iterate(Path(args.child[0]), args.epochs, Path(args.child[1]))
        return
    if shutil.which("perf") is None:
        sys.exit("handoff_profile: `perf` is not installed (Debian: linux-perf)")
    data = make_data(args.out / "handoff-data")
    ready = args.out / "handoff.ready"
    ready.unlink(missing_ok=True)
    record = args.out / "handoff.perf.data"
    child = subprocess.Popen(
        [sys.executable, __file__, "--epochs", str(args.epochs), "--child", str(data), str(ready)]
    )
    try:
        for _ in range(600):
            if ready.exists() or child.poll() is not None:
                break
            time.sleep(0.1)
        if not ready.exists():
            sys.exit("handoff_profile: the child did not get through its warm-up epoch")
        perf = ["perf", "record", "-q", "-F", "1999", "-p", str(child.pid), "-o", str(record)]
        subprocess.run(perf, check=True, timeout=600)
    finally:
        child.wait(timeout=600)
    for sort, top in (("dso", 10), ("dso,symbol", args.top)):
        report = ["perf", "report", "-i", str(record), "--no-children", "--sort", sort, "-q"]
        out = subprocess.run(report, capture_output=True, text=True, check=True, timeout=600)
        print("\n".join(line[:140] for line in out.stdout.splitlines()[:top]))
        print()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

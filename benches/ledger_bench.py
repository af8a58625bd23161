"""The cost of the sample ledger: one epoch of small local samples read in
the main process, each batch touched, with and without
``shardstream.Ledger.track`` recording every batch (``sample_ids=True`` in
both), runs alternated, medians of ``--repeats``; the time spent in the
ledger's own calls per sample, and its share of the 2.5 us a sample takes
at 400,000 samples/s; and the ledger's bytes on disk per sample. The fsync
that ``checkpoint()`` and ``close()`` make is paid once per checkpoint, so
the epoch is timed up to its last batch::

    python benches/ledger_bench.py --out bench-results [--samples 400000] [--size 200]

Two hand-offs: Rust batches (``batch_size=`` on the dataset: ``__id__`` is
one ``(B, 3)`` array per batch) and per-sample dicts batched by a
DataLoader (``__id__`` three tensors per batch after the default collate).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from mix_bench import write_stream  # benches/, the directory of this script

from shardstream import Ledger, StreamingDataset


def one_epoch(
    spec: str, mode: str, batch: int, ledger_dir: Path | None
) -> tuple[float, int, float]:
    """Seconds and samples of one epoch in this process, each batch's
    bytes touched (their lengths summed), and the seconds spent in the
    ledger's own calls when ``ledger_dir`` is given (each batch recorded
    as a step, then the epoch's end, as ``Ledger.track`` does)."""
    from torch.utils.data import DataLoader

    if mode == "rust":
        ds = StreamingDataset(spec, seed=0, sample_ids=True, batch_size=batch)
        loader: Any = ds
    else:
        ds = StreamingDataset(spec, seed=0, sample_ids=True)
        loader = DataLoader(ds, batch_size=batch, num_workers=0)
    ledger = Ledger(ledger_dir, ds, num_workers=1) if ledger_dir is not None else None
    samples = touched = 0
    own = 0.0
    clock = time.perf_counter
    start = clock()
    for b in loader:
        if ledger is not None:
            before = clock()
            ledger.record(b)
            own += clock() - before
        values = b["bin"]
        touched += sum(len(v) for v in values)
        samples += len(values)
    if ledger is not None and ledger.last_epoch is not None:
        before = clock()
        ledger.epoch_end(ledger.last_epoch)
        own += clock() - before
    seconds = clock() - start
    # The fsync of close() (as at a checkpoint) is paid once per checkpoint,
    # not per sample: left out of the epoch's time.
    if ledger is not None:
        ledger.close()
    assert touched > 0
    return seconds, samples, own


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--samples", type=int, default=400_000)
    parser.add_argument("--size", type=int, default=200, help="bytes per sample")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.samples < 8 or args.repeats < 1 or args.batch < 1:
        parser.error("--samples must be at least 8, --repeats and --batch at least 1")

    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ledger-bench-", dir=args.out))
    rows = []
    try:
        spec = write_stream(work / "data", "s", 8, args.samples // 8, args.size)
        for mode in ("rust", "dataloader"):
            plain, recorded, own_ns, disk = [], [], [], []
            for repeat in range(args.repeats):
                seconds, samples, _ = one_epoch(spec, mode, args.batch, None)
                plain.append(samples / seconds)
                ledger_dir = work / f"ledger-{mode}-{repeat}"
                seconds, samples, own = one_epoch(spec, mode, args.batch, ledger_dir)
                recorded.append(samples / seconds)
                own_ns.append(own / samples * 1e9)
                written = sum(p.stat().st_size for p in ledger_dir.rglob("*.bin"))
                disk.append(written / samples)
                shutil.rmtree(ledger_dir)
            ns = statistics.median(own_ns)
            rows.append(
                {
                    "hand-off": mode,
                    "batch": args.batch,
                    "samples_per_s_without": statistics.median(plain),
                    "samples_per_s_with": statistics.median(recorded),
                    "ledger_ns_per_sample": ns,
                    # Of the 2.5 us a sample takes at 400,000 samples/s.
                    "percent_at_400k": 100 * ns / 2500,
                    "disk_bytes_per_sample": statistics.median(disk),
                }
            )
            print(
                f"{mode}: {rows[-1]['samples_per_s_without']:,.0f} samples/s without, "
                f"{rows[-1]['samples_per_s_with']:,.0f} with the ledger; its own calls "
                f"{ns:.1f} ns per sample ({rows[-1]['percent_at_400k']:.2f}% at 400,000 "
                f"samples/s), {rows[-1]['disk_bytes_per_sample']:.2f} bytes per sample on disk",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (args.out / "ledger_bench.json").write_text(json.dumps(rows, indent=2))
    lines = [
        f"{args.samples:,} samples of {args.size} bytes, batches of {args.batch}, "
        f"medians of {args.repeats}, main process",
        "",
        "| hand-off | samples/s without | with the ledger | ledger's own ns per sample "
        "| share at 400,000 samples/s | bytes per sample on disk |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['hand-off']} | {r['samples_per_s_without']:,.0f} | "
            f"{r['samples_per_s_with']:,.0f} | {r['ledger_ns_per_sample']:.1f} | "
            f"{r['percent_at_400k']:.2f}% | {r['disk_bytes_per_sample']:.2f} |"
        )
    (args.out / "ledger_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

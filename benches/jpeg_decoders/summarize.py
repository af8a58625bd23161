"""Summary of the JPEG decoder bench (``benches/jpeg_decoders``) as Markdown.

Reads the per-pass CSV files that the Rust bench and ``pil_bench.py`` append
to (``RAW=raw.r<round>.csv``; rows ``who,image set,variant,cpu ms,wall ms``)
and prints, per image set and variant: the median over all passes of all
rounds of the CPU ms per image, its 10th-90th percentiles and min-max, the
wall median, and the ratio to PIL's pipeline (RandomResizedCrop with
torchvision's own boxes) both of the overall medians and per round (the
Rust and PIL benches run back to back in a round, so a round's ratio
cancels slow drifts of the machine's load) as median [min-max] over rounds,
and the ratio to PIL's fixed-box pipeline.

    python summarize.py OUT/raw.r*.csv > OUT/summary.md
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
from collections import defaultdict
from pathlib import Path

PIL_PIPELINE = "PIL decode+RRC224+flip+PILToTensor (torchvision random boxes)"
PIL_FIXED = "PIL decode+resized_crop(fixed boxes)+flip+pil_to_tensor"


def quantile(v: list[float], p: float) -> float:
    """The value at fraction ``p`` of the sorted ``v`` (nearest rank)."""
    v = sorted(v)
    return v[min(len(v) - 1, int(p * (len(v) - 1) + 0.5))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw", type=Path, nargs="+", help="raw.r<round>.csv files")
    args = parser.parse_args()
    rows: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    per_round: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    for path in args.raw:
        found = re.search(r"raw\.r(\d+)\.csv$", path.name)
        assert found, f"{path}: not a raw.r<round>.csv file"
        r = int(found.group(1))
        with path.open(newline="") as f:
            for _who, dset, name, cpu, wall in csv.reader(f):
                key = (Path(dset).name, name)
                rows[key].append((float(cpu), float(wall)))
                per_round[(*key, r)].append(float(cpu))
    rounds = sorted({k[2] for k in per_round})

    for dset in sorted({d for d, _ in rows}):
        pil = statistics.median(c for c, _ in rows[(dset, PIL_PIPELINE)])
        pilfix = statistics.median(c for c, _ in rows[(dset, PIL_FIXED)])
        print(
            f"\n## {dset}: {len(rounds)} rounds; PIL pipeline {pil:.3f} ms, "
            f"PIL fixed-box pipeline {pilfix:.3f} ms (CPU medians)\n"
        )
        print(
            "| variant | passes | CPU ms median | p10-p90 | min-max | wall ms median "
            "| / PIL pipeline | per round: median [min-max] | / PIL fixed boxes |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for (d, name), t in rows.items():
            if d != dset:
                continue
            c = [x[0] for x in t]
            w = [x[1] for x in t]
            m = statistics.median(c)
            rr = [
                statistics.median(per_round[(d, name, r)])
                / statistics.median(per_round[(d, PIL_PIPELINE, r)])
                for r in rounds
            ]
            print(
                f"| {name} | {len(c)} | {m:.3f} | {quantile(c, 0.1):.3f}-{quantile(c, 0.9):.3f} "
                f"| {min(c):.3f}-{max(c):.3f} | {statistics.median(w):.3f} | {m / pil:.2f}x "
                f"| {statistics.median(rr):.2f}x [{min(rr):.2f}-{max(rr):.2f}] "
                f"| {m / pilfix:.2f}x |"
            )


if __name__ == "__main__":
    main()

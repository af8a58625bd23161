"""Where one shardstream epoch of a peers-bench profile spends its time.

Runs one epoch per fresh process through the same DataLoader as
`peers_bench.py` (batch 32, `collate_fn=list`), alternating the dataset's
default options with each `--compare` setting (A B A B ...), and prints the
medians of: time to the first batch, time from there to the last batch, CPU
of the run and its workers, and minor page faults in the main process and in
the workers. Data: a profile that `make bench-peers` generated.

    .venv-peers/bin/python benches/peers/epoch_phases.py --profile audio \\
        --workers 2 --compare raise_malloc_thresholds=false
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import peers_bench  # noqa: E402

LIBRARY = "shardstream"
COLUMNS = ("first_batch_ms", "rest_ms", "cpu_ms", "main_faults", "worker_faults", "samples")


def parse_setting(text: str) -> tuple[str, Any]:
    """`name=value` with a JSON value (`false`, `3`, `"x"`); bare words are strings."""
    name, _, value = text.partition("=")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def run_epoch(data: Path, workers: int, settings: dict[str, Any]) -> dict[str, float]:
    """One epoch in this process, the dataset's options changed by `settings`."""
    from torch.utils.data import DataLoader

    peers_bench.import_library(LIBRARY)
    with tempfile.TemporaryDirectory() as cache:
        # Options given to the constructor: it checks them, and an attribute
        # set afterwards would not reach `dataset.options`.
        dataset, batching = peers_bench.make_dataset_for(LIBRARY, data, Path(cache), settings)
        self0 = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        batches = iter(DataLoader(dataset, num_workers=workers, **batching))
        samples = len(next(batches))
        first = time.perf_counter()
        samples += sum(len(batch) for batch in batches)
        end = time.perf_counter()
        del batches
        self1 = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = sum(
        getattr(self1, f) - getattr(self0, f) + getattr(children, f)
        for f in ("ru_utime", "ru_stime")
    )
    return {
        "first_batch_ms": 1000 * (first - start),
        "rest_ms": 1000 * (end - first),
        "cpu_ms": 1000 * cpu,
        "main_faults": self1.ru_minflt - self0.ru_minflt,
        "worker_faults": children.ru_minflt,
        "samples": samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=list(peers_bench.PROFILES), default="audio")
    parser.add_argument("--data-root", type=Path, default=Path("bench-results/peers-data"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compare", nargs="*", default=[], help="option=value settings")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    data = args.data_root / args.profile
    if args.child is not None:
        print(json.dumps(run_epoch(data, args.workers, json.loads(args.child))))
        return
    if not (data / "meta.json").exists():
        raise SystemExit(f"error: no profile at {data} (make bench-peers generates it)")
    configs = [{}, *({name: value} for name, value in map(parse_setting, args.compare))]
    from shardstream import _core

    options = _core.default_options()
    for name in (name for config in configs for name in config):
        if name not in options:
            raise SystemExit(f"error: StreamingDataset has no option {name!r}")
    expected = len(peers_bench.load_meta(data)["keys"])
    runs: list[list[dict[str, float]]] = [[] for _ in configs]
    for _ in range(args.repeats):
        for config, results in zip(configs, runs, strict=True):
            child = [sys.executable, __file__, "--profile", args.profile]
            child += ["--data-root", str(args.data_root), "--workers", str(args.workers)]
            out = subprocess.run(
                [*child, "--child", json.dumps(config)],
                capture_output=True,
                text=True,
                timeout=peers_bench.CHILD_TIMEOUT,
            )
            if out.returncode != 0:
                raise SystemExit(f"error: the run with {config} failed:\n{out.stderr[-4000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            if result["samples"] != expected:
                raise SystemExit(f"error: {result['samples']} samples, expected {expected}")
            results.append(result)
    print(f"{args.profile}, {args.workers} workers, medians of {args.repeats}:")
    print("| options | " + " | ".join(COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for config, results in zip(configs, runs, strict=True):
        name = ", ".join(f"{k}={v}" for k, v in config.items()) or "defaults"
        medians = [statistics.median(r[c] for r in results) for c in COLUMNS]
        print(f"| {name} | " + " | ".join(f"{m:,.0f}" for m in medians) + " |")


if __name__ == "__main__":
    main()

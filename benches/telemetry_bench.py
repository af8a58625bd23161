"""What the per-stage telemetry costs: one epoch of small samples (a 200-byte
`.txt` and a `.cls`, 8 shards x 25,000) at num_workers=0 through a per-sample
`DataLoader(batch_size=32, collate_fn=list)` and a len-only consumer, with
this build and with a baseline build without telemetry, interleaved.

    python benches/telemetry_bench.py --data bench-results/telemetry \
        --baseline BASELINE_DIR [--current CURRENT_DIR] [--repeats 5]

BASELINE_DIR holds a `shardstream` package of the build to compare with (a
wheel unpacked: `python -m zipfile -e dist/shardstream-*.whl BASELINE_DIR`),
CURRENT_DIR likewise the build measured (default: the one installed); each
run is a fresh subprocess with its directory first on `PYTHONPATH`. The
figures are the medians, over the repetitions (interleaved), of this
build's CPU time per sample (user + system, every thread of the process)
over the baseline's, less one, and of the same for wall time (samples/s):
on a machine other work shares, CPU time is the steadier of the two.

With `--callgrind`, it counts instructions instead, which other work on the
machine does not change: each build iterates its `_core.SampleStream`
(without torch or the DataLoader, so the telemetry's share is the largest
it can be) 50,000 and 150,000 samples under valgrind's callgrind with
`PYTHONHASHSEED=0`; the difference over 100,000 is the instructions per
sample. That needs `--current` too (both packages are loaded from their
directories).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

SHARDS, PER_SHARD, TEXT_BYTES = 8, 25_000, 200


def make_small(out: Path) -> str:
    """The shards (made once) and their spec."""
    out.mkdir(parents=True, exist_ok=True)
    letters = b"abcdefghijklmnopqrstuvwxyz     "
    for shard in range(SHARDS):
        path = out / f"shard-{shard:06d}.tar"
        if path.exists():
            continue
        rng = random.Random(f"telemetry-{shard}")
        tmp = path.with_suffix(".tmp")
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(PER_SHARD):
                key = f"small-{shard:06d}-{i:06d}"
                for name, data in (
                    (f"{key}.txt", bytes(rng.choices(letters, k=TEXT_BYTES))),
                    (f"{key}.cls", b"%d" % rng.randrange(10)),
                ):
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime, info.mode = len(data), 0, 0o644
                    tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, path)
    return str(out / f"shard-{{000000..{SHARDS - 1:06d}}}.tar")


def child(spec: str) -> None:
    """One epoch; prints samples/s and where shardstream was imported from."""
    from torch.utils.data import DataLoader

    import shardstream

    dataset = shardstream.StreamingDataset(spec, seed=0, shuffle_buffer=1000)
    loader = DataLoader(dataset, batch_size=32, num_workers=0, collate_fn=list)
    sum(len(batch) for batch in DataLoader(dataset, batch_size=32, collate_fn=list))  # warm-up
    usage = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    samples = sum(len(batch) for batch in loader)
    elapsed = time.perf_counter() - start
    end = resource.getrusage(resource.RUSAGE_SELF)
    cpu = end.ru_utime + end.ru_stime - usage.ru_utime - usage.ru_stime
    print(
        json.dumps(
            {
                "samples_per_s": samples / elapsed,
                "cpu_ns_per_sample": cpu / samples * 1e9,
                "module": shardstream.__file__,
                "telemetry": "pipeline_ns" in dataset.stats(),
            }
        )
    )


def core_child(package_dir: str, spec: str, limit: int) -> None:
    """Iterates `limit` samples through the `_core` of `package_dir` alone."""
    import types

    package = types.ModuleType("shardstream")
    package.__path__ = [str(Path(package_dir) / "shardstream")]
    sys.modules["shardstream"] = package
    from shardstream import _core

    shards = _core.ShardList([spec], _core.Options(shuffle_buffer=1000))
    for count, _ in enumerate(_core.SampleStream(shards, epoch=0), start=1):
        if count >= limit:
            break


def instructions(package_dir: str, spec: str, limit: int, scratch: Path) -> int:
    """The instructions callgrind counts in `core_child`."""
    out = scratch / f"callgrind.{os.getpid()}.out"
    done = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            sys.executable,
            __file__,
            "--core-child",
            package_dir,
            spec,
            str(limit),
        ],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    out.unlink()
    collected = [line for line in done.stderr.splitlines() if "Collected :" in line]
    return int(collected[-1].rsplit(":", 1)[1])


def per_sample(package_dir: str, spec: str, scratch: Path) -> float:
    few, many = 50_000, 150_000
    counts = [instructions(package_dir, spec, n, scratch) for n in (few, many)]
    return (counts[1] - counts[0]) / (many - few)


def run(spec: str, baseline: str | None) -> dict:
    env = dict(os.environ)
    if baseline is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [baseline, env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, __file__, "--child", spec],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("bench-results/telemetry"))
    parser.add_argument("--baseline", required=False, help="a baseline build's package directory")
    parser.add_argument("--current", help="the measured build's package directory")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--callgrind", action="store_true", help="count instructions")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--core-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    if args.core_child:
        core_child(args.core_child[0], args.core_child[1], int(args.core_child[2]))
        return
    spec = make_small(args.data)
    if args.callgrind:
        if not (args.baseline and args.current):
            parser.error("--callgrind needs --baseline and --current")
        current = per_sample(args.current, spec, args.data)
        base = per_sample(args.baseline, spec, args.data)
        result = {
            "current_instructions_per_sample": current,
            "baseline_instructions_per_sample": base,
            "overhead": current / base - 1,
        }
        print(json.dumps(result))
        return
    rows = []
    for repeat in range(args.repeats):
        current = run(spec, args.current)
        assert current["telemetry"], current
        row = {"current": current["samples_per_s"], "current_cpu_ns": current["cpu_ns_per_sample"]}
        if args.baseline:
            base = run(spec, args.baseline)
            assert not base["telemetry"], f"the baseline has telemetry: {base['module']}"
            row["baseline"] = base["samples_per_s"]
            row["baseline_cpu_ns"] = base["cpu_ns_per_sample"]
            row["overhead_wall"] = row["baseline"] / row["current"] - 1
            row["overhead_cpu"] = row["current_cpu_ns"] / row["baseline_cpu_ns"] - 1
        rows.append(row)
        print(json.dumps({"repeat": repeat, **row}), flush=True)
    summary = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    print(json.dumps({"medians": summary}))


if __name__ == "__main__":
    main()

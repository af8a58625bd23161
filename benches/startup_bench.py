"""Start-up at scale: one resolution per job for a synthetic resolved list of
1,000,000 shards, without a file or a request. Measures the broadcast form
(bytes per shard, encode and decode), the start-up of N local processes of a
real ``torch.distributed`` gloo group in which rank 0 publishes its
resolution and the others receive it (``shardstream.job_resolution``,
unchanged, through the group's TCPStore), the store requests and resolutions
that takes, the memory of one DataLoader worker holding the list (fork and
spawn), and the plan of one slot of 1,000,000 shards x 4,096 slots.

    python benches/startup_bench.py --out bench-results [--shards 1000000] [--ranks 8,16,32,64]

The list is what an S3 listing of ``s3://bench-bucket/images/`` with
``format="raw"`` resolves to: one object per shard, one sample each, its
size and ETag (``--samples-per-shard K`` makes tar shards with a manifest's
index of K samples instead). It is written in the compact form that
``ShardList.__reduce__`` gives and ``_rebuild_shard_list`` reads (checked:
the rebuilt list encodes to the same bytes); its URLs are never read.

The ranks are processes forked from this one (the torch import shared, as
torchrun's are not), each joining the group on 127.0.0.1. A layout whose
estimated memory (the decoded list and the transient copies of the
broadcast form per rank) exceeds ``--memory-budget-gib`` (default: half of
MemAvailable) runs with ``--fallback-shards`` instead, and says so; every
run is bounded by ``--run-timeout`` seconds and the whole benchmark by
``--deadline``. Results go to ``OUT/startup_bench.json`` and a markdown
table to stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from shardstream import StreamingDataset, job_resolution
from shardstream._core import Options, SampleStream, _rebuild_shard_list, plan_epoch, plan_samples

SPEC = "s3://bench-bucket/images/"
# A fallback resolution (which the job must never make) fails at once here
# rather than reaching a real S3 endpoint.
OPTIONS: dict[str, Any] = {
    "s3": {"endpoint_url": "http://127.0.0.1:9", "region": "us-east-1", "max_attempts": 1},
}
# Keys per ListObjectsV2 page (S3's maximum), for the listing requests that
# each resolution of the prefix would make.
LIST_PAGE = 1000
# The layout of the plan figures: 512 ranks x 8 workers = 4,096 slots.
PLAN_WORLD, PLAN_WORKERS = 512, 8
MIB = 1 << 20
# The largest value torch's default TCPStore server (libuv) takes: it drops
# a client that sends more ("Invalid payload size. size: ..., max: 8388608").
LIBUV_MAX_VALUE = 8 * MIB


def uint(n: int) -> bytes:
    """``n`` as LEB128, as the compact form writes integers."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(data: bytes) -> bytes:
    return uint(len(data)) + data


def synthetic_form(shards: int, samples_per_shard: int | None) -> bytes:
    """The compact form (``SSL1``) of ``shards`` shards: raw objects of one
    sample (``samples_per_shard`` 0), tar shards with a manifest's index of
    ``samples_per_shard`` samples, or tar shards of unknown count (``None``,
    a listing alone); each with a size and an ETag, as a listing gives."""
    if samples_per_shard == 0:
        names = [f"{SPEC}{i:07d}.jpg" for i in range(shards)]
        tail = b"\x01\x00"  # raw, no sample index
        sizes = [60_000 + (i * 7919) % 80_000 for i in range(shards)]
    else:
        names = [f"{SPEC}shard-{i:07d}.tar" for i in range(shards)]
        if samples_per_shard is None:
            tail = b"\x00\x00"  # tar, no sample index
        else:
            # Spans of 10 KiB samples after their 512-byte headers: the gap
            # since the previous span's end, then the length.
            tail = (
                b"\x00\x01"
                + uint(samples_per_shard)
                + (uint(512) + uint(10240)) * (samples_per_shard)
            )
        per_shard = (512 + 10240) * max(samples_per_shard or 100, 1) + 1024
        sizes = [per_shard] * shards
    parts = [b"SSL1", uint(0), uint(shards)]
    for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
        etag = f'"{i * 2654435761 % (1 << 64):032x}"'.encode()
        parts += [field(name.encode()), b"\x01", uint(size), b"\x01", field(etag), tail]
    return b"".join(parts)


def options_for(samples_per_shard: int | None) -> dict[str, Any]:
    return dict(OPTIONS, format="raw") if samples_per_shard == 0 else dict(OPTIONS)


def rebuild(form: bytes, samples_per_shard: int | None) -> Any:
    """The ``ShardList`` of ``form``, as unpickling makes it."""
    options = Options(**options_for(samples_per_shard))
    return _rebuild_shard_list([SPEC], options, None, False, form)


def memory() -> dict[str, int]:
    """This process's resident memory in bytes: ``rss``, ``pss``,
    ``uss`` (private pages) and ``anon`` (anonymous pages)."""
    text = Path("/proc/self/smaps_rollup").read_text()

    def kib(name: str) -> int:
        match = re.search(rf"^{name}:\s+(\d+) kB", text, re.M)
        return int(match.group(1)) * 1024 if match else 0

    return {
        "rss": kib("Rss"),
        "pss": kib("Pss"),
        "uss": kib("Private_Clean") + kib("Private_Dirty"),
        "anon": kib("Anonymous"),
    }


def available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def best_of(repeats: int, fn: Any) -> tuple[float, Any]:
    """The fastest of ``repeats`` timed calls of ``fn`` and its last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def held_by_list(form: bytes, samples_per_shard: int | None, timeout: float) -> int:
    """The anonymous memory the list of ``form`` takes once decoded, in a
    fresh process (a long-running one reuses memory it freed before)."""
    with tempfile.NamedTemporaryFile(suffix=".ssl") as f:
        f.write(form)
        f.flush()
        kind = "none" if samples_per_shard is None else str(samples_per_shard)
        proc = subprocess.run(
            [sys.executable, __file__, "--held", f.name, kind],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )
    return int(proc.stdout.strip().splitlines()[-1])


def print_held(path: str, kind: str) -> None:
    samples_per_shard = None if kind == "none" else int(kind)
    form = Path(path).read_bytes()
    gc.collect()
    before = memory()["anon"]
    shard_list = rebuild(form, samples_per_shard)
    print(memory()["anon"] - before if len(shard_list) else 0)


def measure_form(
    form: bytes, samples_per_shard: int | None, repeats: int, timeout: float
) -> dict[str, Any]:
    """Bytes per shard of the compact form ``form`` and of the broadcast
    form, the time to encode and decode each, and the memory the decoded
    list holds."""
    shard_list = rebuild(form, samples_per_shard)
    shards = len(shard_list)
    held = held_by_list(form, samples_per_shard, timeout)
    _, (_, _, _, _, again) = shard_list.__reduce__()
    if again != form:
        raise SystemExit("the synthetic form is not what ShardList.__reduce__ encodes")
    options = Options(**options_for(samples_per_shard))
    decode_s, _ = best_of(repeats, lambda: rebuild(form, samples_per_shard))
    encode_s, _ = best_of(repeats, lambda: shard_list.__reduce__())
    wire_encode_s, wire = best_of(repeats, lambda: job_resolution._encoded(shard_list))
    wire_decode_s, copy = best_of(repeats, lambda: job_resolution._decoded(wire, options))
    if len(copy) != shards:
        raise SystemExit("the broadcast form did not decode to the same shards")
    return {
        "shards": shards,
        "samples_per_shard": samples_per_shard,
        "form_bytes": len(form),
        "form_bytes_per_shard": len(form) / shards,
        "wire_bytes": len(wire),
        "wire_bytes_per_shard": len(wire) / shards,
        "decoded_bytes_per_shard": held / shards,
        "form_encode_s": encode_s,
        "form_decode_s": decode_s,
        "wire_encode_s": wire_encode_s,
        "wire_decode_s": wire_decode_s,
    }


def measure_plan(form: bytes, samples_per_shard: int | None, repeats: int) -> dict[str, Any]:
    """One slot's plan as a stream computes it (``SampleStream(...)`` plans
    its slot at construction; ``units`` reads it), for slots 0 and 4,095,
    and the whole plan of every slot (``plan_samples`` with sample counts,
    ``plan_epoch`` by bytes)."""
    shard_list = rebuild(form, samples_per_shard)
    slots = PLAN_WORLD * PLAN_WORKERS
    result: dict[str, Any] = {"shards": len(shard_list), "slots": slots}
    per_slot = []
    for slot in (0, slots - 1):
        rank, worker = divmod(slot, PLAN_WORKERS)

        def one_slot(rank: int = rank, worker: int = worker) -> int:
            stream = SampleStream(
                shard_list,
                world_size=PLAN_WORLD,
                rank=rank,
                num_workers=PLAN_WORKERS,
                worker_id=worker,
            )
            return len(stream.units)

        seconds, units = best_of(repeats, one_slot)
        per_slot.append({"slot": slot, "seconds": seconds, "units": units})
    result["slot_plans"] = per_slot
    result["slot_plan_s"] = max(p["seconds"] for p in per_slot)
    counts_s, counts = best_of(1, lambda: shard_list.sample_counts)
    result["sample_counts_s"] = counts_s
    if counts is not None:
        seconds, plan = best_of(
            repeats,
            lambda: plan_samples(
                counts, seed=0, epoch=0, world_size=PLAN_WORLD, num_workers=PLAN_WORKERS
            ),
        )
        result["whole_plan_samples_s"] = seconds
        result["whole_plan_units"] = sum(len(units) for units in plan)
        del plan
    sizes = shard_list.sizes
    seconds, plan = best_of(
        repeats,
        lambda: plan_epoch(sizes, seed=0, epoch=0, world_size=PLAN_WORLD, num_workers=PLAN_WORKERS),
    )
    result["whole_plan_by_bytes_s"] = seconds
    return result


class WorkerProbe(IterableDataset):
    """Holds a shard list; in a DataLoader worker, reports the worker's
    memory before and after planning its slot of 512 x 8 (it reads
    nothing)."""

    def __init__(self, shard_list: Any, slot: int) -> None:
        self.shard_list = shard_list
        self.slot = slot

    def __iter__(self) -> Iterator[dict[str, Any]]:
        holding = memory()
        start = time.perf_counter()
        rank, worker = divmod(self.slot, PLAN_WORKERS)
        stream = SampleStream(
            self.shard_list,
            world_size=PLAN_WORLD,
            rank=rank,
            num_workers=PLAN_WORKERS,
            worker_id=worker,
        )
        units = len(stream.units)
        yield {
            "holding": holding,
            "planned": memory(),
            "plan_s": time.perf_counter() - start,
            "units": units,
        }


def measure_worker(shard_list: Any, context: str, timeout: float) -> dict[str, Any]:
    loader = DataLoader(
        WorkerProbe(shard_list, slot=PLAN_WORLD * PLAN_WORKERS - 1),
        batch_size=None,
        num_workers=1,
        multiprocessing_context=context,
        timeout=timeout,
    )
    start = time.perf_counter()
    (report,) = list(loader)
    report["first_item_s"] = time.perf_counter() - start
    return report


def measure_workers(form: bytes, samples_per_shard: int | None, timeout: float) -> dict[str, Any]:
    """A DataLoader worker (fork, spawn) holding the whole list and one
    holding a list of one shard (the baseline of an empty worker)."""
    small = rebuild(synthetic_form(1, samples_per_shard), samples_per_shard)
    shard_list = rebuild(form, samples_per_shard)
    gc.collect()
    result = {"main": memory()}
    for context in ("fork", "spawn"):
        result[context] = {
            "one_shard": measure_worker(small, context, timeout),
            "all_shards": measure_worker(shard_list, context, timeout),
        }
    return result


class CountingStore:
    """The group's store, counting the calls ``job_resolution`` makes on it
    and the bytes its ``get`` returns."""

    def __init__(self, store: Any, calls: Counter[str]) -> None:
        self._store = store
        self._calls = calls

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._calls[name] += 1
            value = attr(*args, **kwargs)
            if name == "get":
                self._calls["get_bytes"] += len(value)
            return value

        return counted


def store_backend() -> str:
    """The kind of server behind the default group's store."""
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    libuv = getattr(store, "libuvBackend", None)
    return {True: "libuv", False: "legacy"}.get(libuv, type(store).__name__)


def rank_main(
    rank: int,
    world: int,
    port: int,
    form: bytes,
    samples_per_shard: int | None,
    backend: str,
    out: str,
) -> None:
    """One rank: joins the group, then makes the dataset: rank 0 resolves
    (here: rebuilds the synthetic list, standing for the listing) through
    ``resolve_once``, as ``StreamingDataset`` does; every other rank makes
    a ``StreamingDataset``, which receives rank 0's resolution."""
    record: dict[str, Any] = {"rank": rank}
    try:
        if backend == "legacy":
            # torch's TCPStore server without libuv (read when it is made).
            os.environ["USE_LIBUV"] = "0"
        start = time.monotonic()
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=300),
        )
        record["init_s"] = time.monotonic() - start
        record["backend"] = store_backend()
        calls: Counter[str] = Counter()
        real_store = job_resolution._default_store
        job_resolution._default_store = lambda: CountingStore(real_store(), calls)
        resolutions = 0
        dist.barrier()
        options = options_for(samples_per_shard)
        record["start"] = time.monotonic()
        cpu = cpu_seconds()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if rank == 0:

                def resolve() -> Any:
                    nonlocal resolutions
                    resolutions += 1
                    return rebuild(form, samples_per_shard)

                shard_list = job_resolution.resolve_once([SPEC], Options(**options), resolve, True)
            else:
                shard_list = StreamingDataset(SPEC, **options).shard_list
        record["end"] = time.monotonic()
        record["cpu_s"] = cpu_seconds() - cpu
        record["shards"] = len(shard_list)
        record["resolutions"] = resolutions
        record["fallbacks"] = sum("did not resolve" in str(w.message) for w in caught)
        record["store_calls"] = dict(calls)
        record["memory"] = memory()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as error:  # reported by the parent, which times the run
        record["error"] = f"{type(error).__name__}: {error}"
        record["failed_after_s"] = time.monotonic() - record.get("start", start)
    Path(out, f"rank-{rank}.json").write_text(json.dumps(record))
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def broadcast_run(
    world: int,
    form: bytes,
    samples_per_shard: int | None,
    shards: int,
    backend: str,
    timeout: float,
) -> dict[str, Any]:
    """One job of ``world`` local ranks; every rank's record, summed up."""
    fork = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        gc.collect()
        started = time.monotonic()
        procs = [
            fork.Process(
                target=rank_main, args=(r, world, port, form, samples_per_shard, backend, out)
            )
            for r in range(world)
        ]
        for proc in procs:
            proc.start()
        deadline = started + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        killed = [p for p in procs if p.is_alive()]
        for proc in killed:
            proc.kill()
        for proc in killed:
            proc.join(10)
        wall = time.monotonic() - started
        records = [json.loads(path.read_text()) for path in sorted(Path(out).glob("rank-*.json"))]
    result: dict[str, Any] = {
        "ranks": world,
        "shards": shards,
        "backend": backend,
        "timeout_s": timeout,
        "wall_s": wall,
    }
    errors = Counter(r["error"] for r in records if "error" in r)
    result["completed"] = len(records) == world and not killed and not errors
    if not result["completed"]:
        result["errors"] = dict(errors)
        if killed:
            result["errors"][f"still running after {timeout:.0f} s"] = len(killed)
        failed = [r["failed_after_s"] for r in records if "failed_after_s" in r]
        result["failed_after_s"] = max(failed) if failed else None
        return result
    receivers = [r for r in records if r["rank"] != 0]
    rank0 = next(r for r in records if r["rank"] == 0)
    requests = Counter()
    for r in records:
        requests.update(r["store_calls"])
    result.update(
        {
            "init_s": max(r["init_s"] for r in records),
            "startup_s": max(r["end"] for r in records) - min(r["start"] for r in records),
            "publish_s": rank0["end"] - rank0["start"],
            "receive_s_median": statistics.median(r["end"] - r["start"] for r in receivers),
            "receive_cpu_s_median": statistics.median(r["cpu_s"] for r in receivers),
            "resolutions": sum(r["resolutions"] for r in records),
            "fallbacks": sum(r["fallbacks"] for r in records),
            "store_requests": sum(v for k, v in requests.items() if k != "get_bytes"),
            "store_requests_by_call": {k: v for k, v in requests.items() if k != "get_bytes"},
            "store_bytes_received": requests["get_bytes"],
            "list_requests_job": math.ceil(shards / LIST_PAGE),
            "list_requests_every_rank": world * math.ceil(shards / LIST_PAGE),
            "receiver_uss_median": statistics.median(r["memory"]["uss"] for r in receivers),
            "all_ranks_same_list": all(r["shards"] == shards for r in records),
            "store_backend": sorted({r["backend"] for r in records}),
        }
    )
    return result


def per_rank_estimate(form_row: dict[str, Any]) -> float:
    """Bytes one receiving rank needs: the decoded list, and the broadcast
    form three times over while it decodes (store value, JSON string,
    base64-decoded bytes), plus the group's own buffers."""
    return (
        form_row["decoded_bytes_per_shard"] * form_row["shards"]
        + 3 * form_row["wire_bytes"]
        + (48 * MIB)
    )


def broadcast_grid(
    args: argparse.Namespace, form: bytes, form_row: dict[str, Any], began: float
) -> list[dict[str, Any]]:
    """The jobs: torch's default store (libuv) with the whole list; with
    the largest list its values take, when the whole one failed; and the
    store without libuv with the whole list. Each at every rank count that
    fits the memory budget (else with ``--fallback-shards``), within the
    deadline; a list that failed at one rank count is not tried at more."""
    budget = (
        args.memory_budget_gib * (1 << 30)
        if args.memory_budget_gib is not None
        else available_memory() / 2
    )
    worlds = [int(r) for r in args.ranks.split(",")]
    forms: dict[int, tuple[bytes, dict[str, Any]]] = {args.shards: (form, form_row)}

    def form_of(shards: int) -> tuple[bytes, dict[str, Any]]:
        if shards not in forms:
            small = synthetic_form(shards, args.samples_per_shard)
            forms[shards] = (small, measure_form(small, args.samples_per_shard, 1, 60))
        return forms[shards]

    runs: list[dict[str, Any]] = []
    failed: set[tuple[str, int]] = set()

    def run_all(backend: str, shards: int) -> None:
        for world in worlds:
            row: dict[str, Any] = {
                "ranks": world,
                "backend": backend,
                "shards": shards,
                "budget_bytes": budget,
            }
            left = args.deadline - (time.monotonic() - began)
            n, (run_form, run_row) = shards, form_of(shards)
            need = world * per_rank_estimate(run_row)
            if need > budget and shards > args.fallback_shards:
                row["skipped"] = (
                    f"needs about {need / (1 << 30):.1f} GiB, budget {budget / (1 << 30):.1f} GiB"
                )
                runs.append(row)
                n, (run_form, run_row) = args.fallback_shards, form_of(args.fallback_shards)
                need = world * per_rank_estimate(run_row)
                row = {k: v for k, v in row.items() if k != "skipped"} | {"shards": n}
            if need > budget:
                row["skipped"] = (
                    f"needs about {need / (1 << 30):.1f} GiB, budget {budget / (1 << 30):.1f} GiB"
                )
            elif (backend, n) in failed:
                row["skipped"] = "failed with fewer ranks"
            elif left < 30:
                row["skipped"] = "deadline reached"
            if "skipped" in row:
                runs.append(row)
                continue
            run = broadcast_run(
                world,
                run_form,
                args.samples_per_shard,
                n,
                backend,
                min(args.run_timeout, left - 10),
            )
            run["wire_bytes"] = run_row["wire_bytes"]
            if not run["completed"]:
                failed.add((backend, n))
            runs.append(run)
            print(
                f"  {backend}: {world} ranks x {n:,} shards: "
                f"{run.get('startup_s', run.get('errors'))} ({time.monotonic() - began:.0f} s)",
                flush=True,
            )

    run_all("libuv", args.shards)
    if ("libuv", args.shards) in failed:
        fits = int(0.95 * LIBUV_MAX_VALUE / form_row["wire_bytes_per_shard"]) // 1000 * 1000
        run_all("libuv", fits)
    run_all("legacy", args.shards)
    return runs


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def report(results: dict[str, Any]) -> None:
    main_form = results["form"]
    plan = results["plan"]
    print(
        f"\n{main_form['shards']:,} shards, {results['kind']} "
        f"({os.cpu_count()} cores, load average before {results['load_before']}, "
        f"after {results['load_after']})\n"
    )
    print("| figure | value |")
    print("|---|---|")
    print(f"| compact form, bytes per shard | {main_form['form_bytes_per_shard']:.1f} |")
    print(
        f"| broadcast form (JSON, base64), bytes per shard | "
        f"{main_form['wire_bytes_per_shard']:.1f} |"
    )
    print(
        f"| broadcast form, encode / decode (s) | {main_form['wire_encode_s']:.2f} / "
        f"{main_form['wire_decode_s']:.2f} |"
    )
    print(f"| decoded list, bytes per shard held | {main_form['decoded_bytes_per_shard']:.0f} |")
    print(f"| plan of one slot of {plan['slots']:,} (s) | {plan['slot_plan_s']:.3f} |")
    if "whole_plan_samples_s" in plan:
        print(f"| whole plan, {plan['slots']:,} slots (s) | {plan['whole_plan_samples_s']:.3f} |")
    print(f"| whole plan by bytes, no counts (s) | {plan['whole_plan_by_bytes_s']:.3f} |")
    workers = results.get("workers")
    if workers:
        for context in ("fork", "spawn"):
            one = workers[context]["one_shard"]["planned"]
            full = workers[context]["all_shards"]["planned"]
            print(
                f"| DataLoader worker ({context}), RSS / PSS / private MiB, all shards "
                f"(one shard) | {full['rss'] / MIB:.0f} / {full['pss'] / MIB:.0f} / "
                f"{full['uss'] / MIB:.0f} ({one['rss'] / MIB:.0f} / {one['pss'] / MIB:.0f} / "
                f"{one['uss'] / MIB:.0f}) |"
            )
    print(
        "\n| store | ranks | shards | broadcast MB | start-up (s) | rank 0 publishes (s) | "
        "a rank receives (s; CPU s) | resolutions | store requests | LIST requests, job "
        "(every rank listing) | join (s) | bound (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for run in results["broadcast"]:
        head = f"| {run['backend']} | {run['ranks']} | {run['shards']:,} |"
        if "skipped" in run:
            print(f"{head} | not run: {run['skipped']} ||||||||")
            continue
        wire = f" {run['wire_bytes'] / 1e6:.1f} |"
        if not run["completed"]:
            errors = "; ".join(f"{n} x {e[:60]}" for e, n in run["errors"].items())
            print(
                f"{head}{wire} failed after {run.get('failed_after_s') or 0:.1f} s: {errors} "
                f"||||||| {run['timeout_s']:.0f} |"
            )
            continue
        print(
            f"{head}{wire} {run['startup_s']:.2f} | {run['publish_s']:.2f} | "
            f"{run['receive_s_median']:.2f}; {run['receive_cpu_s_median']:.2f} | "
            f"{run['resolutions']} | {run['store_requests']} | "
            f"{run['list_requests_job']:,} ({run['list_requests_every_rank']:,}) | "
            f"{run['init_s']:.1f} | {run['timeout_s']:.0f} |"
        )
    print(
        "\n| samples per shard | compact bytes/shard | broadcast bytes/shard | "
        "held bytes/shard | decode µs/shard |"
    )
    print("|---|---|---|---|---|")
    for row in results["per_shard"]:
        label = {None: "unknown (tar, listing only)", 0: "1 (raw object)"}.get(
            row["samples_per_shard"], f"{row['samples_per_shard']} (tar, manifest index)"
        )
        print(
            f"| {label} | {row['form_bytes_per_shard']:.0f} | {row['wire_bytes_per_shard']:.0f} | "
            f"{row['decoded_bytes_per_shard']:.0f} | "
            f"{1e6 * row['wire_decode_s'] / row['shards']:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--shards", type=int, default=1_000_000)
    parser.add_argument(
        "--samples-per-shard",
        type=int,
        default=0,
        help="0: raw objects of one sample; K: tar shards with a manifest index of K samples",
    )
    parser.add_argument("--ranks", default="8,16,32,64", help="local process counts to run")
    parser.add_argument(
        "--fallback-shards",
        type=int,
        default=100_000,
        help="the list of the rank counts whose memory does not fit the budget",
    )
    parser.add_argument("--memory-budget-gib", type=float, default=None)
    parser.add_argument("--table-shards", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--run-timeout", type=float, default=150.0)
    parser.add_argument("--deadline", type=float, default=540.0)
    parser.add_argument("--skip-workers", action="store_true")
    parser.add_argument("--held", nargs=2, metavar=("FORM", "KIND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.held:
        print_held(*args.held)
        return
    began = time.monotonic()
    kind = (
        "raw objects of one sample"
        if args.samples_per_shard == 0
        else f"tar shards with a manifest index of {args.samples_per_shard} samples"
    )
    results: dict[str, Any] = {"kind": kind, "cores": os.cpu_count(), "load_before": load_average()}
    print(
        f"startup_bench: {args.shards:,} shards, {kind}; load average {results['load_before']}",
        flush=True,
    )

    per_shard = []
    for k in (None, 0, 1, 10, 100, 1000):
        per_shard.append(
            measure_form(synthetic_form(args.table_shards, k), k, args.repeats, args.run_timeout)
        )
    results["per_shard"] = per_shard
    print(f"  per-shard table done ({time.monotonic() - began:.0f} s)", flush=True)

    form = synthetic_form(args.shards, args.samples_per_shard)
    results["form"] = measure_form(form, args.samples_per_shard, args.repeats, args.run_timeout)
    print(f"  broadcast form done ({time.monotonic() - began:.0f} s)", flush=True)
    gc.collect()
    results["plan"] = measure_plan(form, args.samples_per_shard, args.repeats)
    print(f"  plan done ({time.monotonic() - began:.0f} s)", flush=True)
    gc.collect()

    results["broadcast"] = broadcast_grid(args, form, results["form"], began)
    gc.collect()

    if not args.skip_workers:
        results["workers"] = measure_workers(form, args.samples_per_shard, args.run_timeout)
        print(f"  DataLoader workers done ({time.monotonic() - began:.0f} s)", flush=True)
    results["load_after"] = load_average()
    results["seconds"] = time.monotonic() - began
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup_bench.json").write_text(json.dumps(results, indent=2))
    report(results)
    print(f"\n({results['seconds']:.0f} s; {args.out / 'startup_bench.json'})")


if __name__ == "__main__":
    main()

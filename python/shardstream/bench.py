"""``shardstream bench``: reads a dataset through a torch DataLoader with the
options a training run will use, and says how fast it went, what it cost
in CPU and which stage bounds it, with the change that would help.

    shardstream bench SPEC [--workers N] [--batch-size B] [--decode ...]
                           [--option NAME=VALUE ...]
                           [--epochs E | --samples S | --seconds T] [--json]

``--batch-size B`` batches in the DataLoader (``collate_fn=list``);
``--option batch_size=B`` has the dataset collate batches of ``B`` in Rust
instead, which the DataLoader hands over as they are (``batch_size=None``).

``run_bench`` is the same from Python, with a ``consumer`` callback standing
for the training step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

__all__ = ["BenchResult", "main", "run_bench", "verdict"]

STAGES = ("storage", "parse", "decode", "handoff", "consumer")
"""The stages a run can be bound by, in the order ``BenchResult.stages`` lists them."""

OTHER = "other"
"""The share of a run's time no stage accounts for (DataLoader workers
starting, before the first batch), last in ``BenchResult.stages``."""

DEFAULT_SECONDS = 60.0
"""How long a run lasts at most when no limit is given (else one epoch)."""

DEFAULT_BATCH_SIZE = 32
"""Samples per batch when none is given."""


@dataclass
class BenchResult:
    """What one ``run_bench`` measured.

    Attributes:
        samples: samples read.
        seconds: wall time, from creating the loader's iterator to the last batch.
        samples_per_s: ``samples / seconds``.
        mb_per_s: megabytes (10**6) read from storage or the cache per second.
        cpu_seconds: CPU time (user + system) of this process and of its
            DataLoader workers over the run.
        cpu_us_per_sample: ``cpu_seconds`` per sample, in microseconds.
        cores: cores this process may run on.
        stages: the share of the run's wall time each stage accounts for,
            and ``other``, adding up to 1: ``consumer`` (the code the
            batches go to), ``handoff`` (samples turned into Python objects
            and passed on, by the DataLoader too), and the time the loader
            waited for its pipelines, divided among ``storage``, ``parse``
            and ``decode`` as the pipelines spent theirs; ``other`` is what
            none accounts for. The largest stage is the bound.
        bound: the stage that bounds the run (one of ``STAGES``).
        advice: the bound in words, with the change that would help.
        decode_threads_busy: decode threads busy on average.
        cores_idle: cores left idle on average.
        stats: the dataset's counters over the run (``StreamingDataset.stats``).
        options: the loader's options: workers, batch size, whether the
            dataset collates the batches in Rust (``rust_batches``), decode.
    """

    samples: int
    seconds: float
    samples_per_s: float
    mb_per_s: float
    cpu_seconds: float
    cpu_us_per_sample: float
    cores: int
    stages: dict[str, float]
    bound: str
    advice: str
    decode_threads_busy: float
    cores_idle: float
    stats: dict[str, int] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        """The result as one JSON object."""
        return json.dumps(asdict(self), sort_keys=True)

    def summary(self) -> str:
        """The result in a few lines of text."""
        names = {"consumer": "your code", OTHER: "other (workers starting)"}
        shares = ", ".join(
            f"{names.get(name, name)} {share:.0%}" for name, share in self.stages.items()
        )
        return (
            f"{self.samples:,} samples in {self.seconds:.2f} s: "
            f"{self.samples_per_s:,.0f} samples/s, {self.mb_per_s:,.1f} MB/s\n"
            f"CPU: {self.cpu_us_per_sample:,.1f} us per sample "
            f"({self.cpu_seconds:.2f} CPU s, {self.cores} cores)\n"
            f"where the time went: {shares}\n"
            f"{self.advice}"
        )


def _cpu_seconds() -> float:
    """CPU time of this process and of its children that ended."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def verdict(
    stats: Mapping[str, int],
    *,
    seconds: float,
    consumer_seconds: float,
    lanes: int,
    cpu_seconds: float,
    cores: int,
    read_ahead_bytes: int | None = None,
    loader_seconds: float | None = None,
    startup_seconds: float = 0.0,
    rust_batches: bool = False,
) -> tuple[dict[str, float], str, str, float, float]:
    """The stage that bounds a run, from its counters: each stage's share of
    the run's ``seconds``, adding up to 1 with ``other``. The consumer's
    share is ``consumer_seconds`` (time outside the loader); the rest is the
    loader's. Where the dataset is iterated in the consumer's own thread (no
    workers), ``loader_seconds`` is the time spent in the loader's
    ``next()``: what of it was not a wait for the pipeline (nor the
    transform) is the hand-off (the DataLoader's per-sample work included),
    the wait is divided among storage, parse and decode as the pipeline
    spent its time. With ``lanes`` DataLoader workers, the loader's time is
    divided among the stages the workers spent theirs on, as far as they
    were busy (each a lane); while they were not, the workers were starting
    (until the first batch, ``startup_seconds``: other) or the main process
    was receiving their batches (hand-off).
    ``rust_batches``: the dataset collates the batches already, so the
    advice does not suggest it. Returns ``(shares, bound, advice,
    decode_threads_busy, cores_idle)``."""
    span = max(seconds, 1e-9)

    def spent(*keys: str) -> float:
        return sum(stats.get(key, 0) for key in keys) / 1e9

    pipeline = {
        "storage": spent("storage_wait_ns"),
        "parse": spent("parse_ns"),
        "decode": spent("decode_ns", "transform_ns"),
    }
    consumer = min(max(consumer_seconds, 0.0), span)
    loader = span - consumer
    shares = dict.fromkeys(STAGES, 0.0)
    shares["consumer"] = consumer
    other = 0.0
    if loader_seconds is not None:
        waited = min(spent("next_wait_ns", "transform_ns"), loader)
        handoff = min(max(spent("handoff_ns"), loader - waited), loader)
        shares["handoff"] = handoff
        waiting, weights = loader - handoff, pipeline
    else:
        weights = {**pipeline, "handoff": spent("handoff_ns")}
        busy_lanes = min(sum(weights.values()) / max(lanes, 1) / span, 1.0)
        waiting = loader * busy_lanes
        # Workers not busy while the main process waited: they were
        # starting (until the first batch: other), or the main process was
        # receiving their batches (the hand-off's part in it).
        idle_lanes = loader - waiting
        other = min(max(startup_seconds, 0.0), idle_lanes)
        shares["handoff"] = idle_lanes - other
    total = sum(weights.values())
    if total > 0:
        for stage, weight in weights.items():
            shares[stage] += waiting * weight / total
    else:
        other += waiting
    shares = {stage: value / span for stage, value in shares.items()}
    shares[OTHER] = other / span
    bound = max(STAGES, key=lambda stage: shares[stage])
    busy = stats.get("decode_busy_ns", 0) / 1e9 / span
    idle = max(0.0, cores - cpu_seconds / span)
    percent = f"{shares[bound]:.0%}"
    if bound == "storage":
        budget = f" (now {read_ahead_bytes:,})" if read_ahead_bytes is not None else ""
        advice = (
            f"storage-bound: waiting on storage takes {percent} of the run; raise "
            f"read_ahead_bytes{budget} / more workers (num_workers), or cache_dir for "
            "data read more than once"
        )
    elif bound == "parse":
        advice = (
            f"parse-bound: reading the shards' format takes {percent} of the run; more "
            "workers (num_workers) parse in parallel"
        )
    elif bound == "decode":
        python = spent("transform_ns") / max(pipeline["decode"], 1e-9)
        help_text = (
            "raise decode_threads / num_workers"
            if idle >= 1.0
            else "less than one core is idle: lighten the decode or transform, or decode on the GPU"
        )
        advice = (
            f"decode-bound: waiting for decoding and transforms takes {percent} of the run "
            f"({python:.0%} of their time in the Python transform); {busy:.1f} decode threads "
            f"busy, {idle:.1f} of {cores} cores idle; {help_text}"
        )
    elif bound == "handoff":
        collate = (
            ""
            if rust_batches
            else "batches collated in Rust help (StreamingDataset(batch_size=N) with "
            "DataLoader(batch_size=None); bench them with shardstream bench "
            "--option batch_size=N), "
        )
        advice = (
            f"handoff-bound: turning samples into Python objects (and the DataLoader's "
            f"per-sample work) takes {percent} of the run; {collate}more workers "
            "(num_workers) spread it"
        )
    else:
        advice = (
            f"consumer-bound: the loader waits on your code ({percent} of the run is "
            "spent outside the loader); a faster loader would not help"
        )
    return shares, bound, advice, busy, idle


def run_bench(
    spec: str | Sequence[str],
    *,
    workers: int = 0,
    batch_size: int = DEFAULT_BATCH_SIZE,
    rust_batches: bool = False,
    epochs: int | None = None,
    samples: int | None = None,
    seconds: float | None = None,
    consumer: Callable[[list[Any]], object] | None = None,
    consumer_delay_ms: float = 0.0,
    progress: TextIO | None = None,
    **options: Any,
) -> BenchResult:
    """Reads ``spec`` through ``DataLoader(StreamingDataset(spec, **options),
    batch_size=batch_size, num_workers=workers, collate_fn=list)`` (with
    ``rust_batches``: ``DataLoader(StreamingDataset(spec, batch_size=batch_size,
    **options), batch_size=None, num_workers=workers)``, batches collated in
    Rust; ``options`` then holds no ``batch_size``) until
    ``epochs`` epochs, ``samples`` samples or ``seconds`` seconds (whichever
    comes first; without any, one epoch or ``DEFAULT_SECONDS``), calling
    ``consumer(batch)`` on each batch and then sleeping ``consumer_delay_ms``
    (both stand for the training step). Progress goes to ``progress`` (a
    text stream) at the first batch and then about twice a second."""
    from torch.utils.data import DataLoader

    from ._core import read_ahead_budget
    from .dataset import StreamingDataset

    for name, value in (("workers", workers), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"invalid option {name}: expected an int >= 0, got {value!r}")
    if batch_size < 1:
        raise ValueError(f"invalid option batch_size: expected an int >= 1, got {batch_size}")
    for name, limit in (("epochs", epochs), ("samples", samples), ("seconds", seconds)):
        if limit is not None and not limit > 0:
            raise ValueError(f"invalid option {name}: expected a number > 0, got {limit!r}")
    if consumer_delay_ms < 0:
        raise ValueError(
            f"invalid option consumer_delay_ms: expected a number >= 0, got {consumer_delay_ms}"
        )
    if epochs is None and samples is None and seconds is None:
        epochs, seconds = 1, DEFAULT_SECONDS
    if rust_batches:
        dataset = StreamingDataset(spec, batch_size=batch_size, **options)
        loader = DataLoader(dataset, batch_size=None, num_workers=workers)
    else:
        dataset = StreamingDataset(spec, **options)
        loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=list)
    dataset.stats(reset=True)
    cpu_before = _cpu_seconds()
    started = time.perf_counter()
    deadline = started + seconds if seconds is not None else None
    # Progress shows at the first batch, then about twice a second.
    count, epoch, outside, shown = 0, 0, 0.0, started - 1.0
    first_batch: float | None = None
    delay = consumer_delay_ms / 1000
    done = False
    while not done and (epochs is None or epoch < epochs):
        iterator = iter(loader)
        while True:
            batch = next(iterator, None)
            if batch is None:
                break
            count += _samples_in(batch) if rust_batches else len(batch)
            left_loader = time.perf_counter()
            if first_batch is None:
                first_batch = left_loader - started
            if consumer is not None:
                consumer(batch)
            if delay:
                time.sleep(delay)
            now = time.perf_counter()
            outside += now - left_loader
            if progress is not None and now - shown >= 0.5:
                shown = now
                progress.write(
                    f"\r{count:,} samples, {count / (now - started):,.0f} samples/s, "
                    f"{now - started:.1f} s"
                )
                progress.flush()
            if (samples is not None and count >= samples) or (
                deadline is not None and now >= deadline
            ):
                done = True
                break
        # Ends the workers, so that their CPU time is counted.
        del iterator
        epoch += 1
    elapsed = time.perf_counter() - started
    cpu = _cpu_seconds() - cpu_before
    if progress is not None:
        progress.write("\n")
        progress.flush()
    stats = dataset.stats()
    cores = _cores()
    shares, bound, advice, busy, idle = verdict(
        stats,
        seconds=elapsed,
        consumer_seconds=outside,
        lanes=max(workers, 1),
        cpu_seconds=cpu,
        cores=cores,
        read_ahead_bytes=read_ahead_budget(dataset.options["read_ahead_bytes"], workers),
        loader_seconds=elapsed - outside if workers == 0 else None,
        startup_seconds=first_batch or 0.0,
        rust_batches=rust_batches,
    )
    fetched = stats.get("bytes_read", 0) + stats.get("cache_bytes", 0)
    span = max(elapsed, 1e-9)
    return BenchResult(
        samples=count,
        seconds=elapsed,
        samples_per_s=count / span,
        mb_per_s=fetched / 1e6 / span,
        cpu_seconds=cpu,
        cpu_us_per_sample=cpu / max(count, 1) * 1e6,
        cores=cores,
        stages=shares,
        bound=bound,
        advice=advice,
        decode_threads_busy=busy,
        cores_idle=idle,
        stats=stats,
        options={
            "workers": workers,
            "batch_size": batch_size,
            "rust_batches": rust_batches,
            "decode": options.get("decode"),
        },
    )


def _samples_in(batch: Any) -> int:
    """The samples in a batch the dataset collated: a dict batch's keys, or
    an Arrow batch's rows."""
    if isinstance(batch, Mapping):
        return len(batch["__key__"])
    return int(batch.num_rows)


def _decode_option(values: Sequence[str] | None) -> bool | dict[str, str] | None:
    """``--decode`` values: ``true`` (decode by extension) or ``FIELD=DECODER`` pairs."""
    if not values:
        return None
    if len(values) == 1 and values[0].lower() in ("true", "all"):
        return True
    decoders: dict[str, str] = {}
    for value in values:
        name, sep, decoder = value.partition("=")
        if not sep or not name or not decoder:
            raise ValueError(
                f"invalid option --decode: {value!r} is neither 'true' nor FIELD=DECODER "
                "(e.g. jpg=rgb8)"
            )
        decoders[name] = decoder
    return decoders


def _option_value(text: str) -> Any:
    """An ``--option`` value: JSON where it parses, else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardstream bench",
        description=(
            "Read a dataset through a torch DataLoader with the options you train with; "
            "print samples/s, MB/s, CPU per sample and the stage that bounds the loader, "
            "with the change that would help."
        ),
    )
    parser.add_argument("spec", nargs="+", help="dataset spec(s), as StreamingDataset takes")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader num_workers")
    parser.add_argument(
        "--batch-size",
        type=int,
        help="DataLoader batch_size, batches of samples collated in Python (default: 32); "
        "--option batch_size=N has the dataset collate batches of N in Rust instead",
    )
    parser.add_argument(
        "--decode",
        action="append",
        metavar="FIELD=DECODER",
        help="decode a field in Rust (repeatable), or 'true' to decode by extension",
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="any StreamingDataset option, the value as JSON (e.g. read_ahead_bytes=268435456); "
        "batch_size=N: batches of N collated in Rust, handed over by DataLoader(batch_size=None)",
    )
    limits = parser.add_argument_group("limits (the first reached ends the run)")
    limits.add_argument("--epochs", type=int, help="epochs to read")
    limits.add_argument("--samples", type=int, help="samples to read")
    limits.add_argument("--seconds", type=float, help="seconds to read for")
    parser.add_argument(
        "--consumer-delay-ms",
        type=float,
        default=0.0,
        help="sleep this long after each batch, standing for a training step",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``shardstream bench`` with ``argv`` (without the program and
    command names); returns the exit code."""
    from ._core import ShardStreamError

    parser = _parser()
    args = parser.parse_args(argv)
    try:
        options: dict[str, Any] = {}
        for pair in args.option:
            name, sep, value = pair.partition("=")
            if not sep or not name:
                raise ValueError(f"invalid option --option: {pair!r} is not NAME=VALUE")
            options[name] = _option_value(value)
        decode = _decode_option(args.decode)
        if decode is not None:
            options["decode"] = decode
        # --option batch_size=N: the dataset's batches, collated in Rust.
        dataset_batch_size = options.pop("batch_size", None)
        rust_batches = dataset_batch_size is not None
        if rust_batches and args.batch_size is not None:
            raise ValueError(
                "invalid option --batch-size: give either --batch-size N (the DataLoader "
                "batches samples in Python) or --option batch_size=N (the dataset collates "
                "batches in Rust, the DataLoader takes them with batch_size=None), not both"
            )
        if rust_batches:
            batch_size = dataset_batch_size
        else:
            batch_size = DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size
        spec: str | list[str] = args.spec[0] if len(args.spec) == 1 else args.spec
        result = run_bench(
            spec,
            workers=args.workers,
            batch_size=batch_size,
            rust_batches=rust_batches,
            epochs=args.epochs,
            samples=args.samples,
            seconds=args.seconds,
            consumer_delay_ms=args.consumer_delay_ms,
            progress=None if args.quiet else sys.stderr,
            **options,
        )
    except (ValueError, TypeError, ShardStreamError) as error:
        print(f"shardstream bench: {error}", file=sys.stderr)
        return 2
    print(result.to_json() if args.json else result.summary())
    return 0

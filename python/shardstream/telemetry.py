"""Per-stage telemetry: windows of the stream counters (``stats(reset=True)``)
and their Prometheus text exposition (``stats_text()``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

LEVELS = frozenset({"read_ahead_peak_bytes", "read_ahead_bytes", "output_queue_samples"})
"""Counters that are levels (or a high-water mark), not sums: a window
reports their current value rather than a difference."""

STAGE_TIMES = {
    "storage_wait": "storage_wait_ns",
    "parse": "parse_ns",
    "decode": "decode_ns",
    "transform": "transform_ns",
    "handoff": "handoff_ns",
    "output_wait": "output_wait_ns",
    "next_wait": "next_wait_ns",
}
"""The ``stage`` label of ``shardstream_stage_seconds_total``, and the
``stats()`` key (nanoseconds) it is read from."""

_STAGE_BYTES = {
    "storage": "bytes_read",
    "cache": "cache_bytes",
    "parse": "parsed_bytes",
    "decode": "decoded_bytes",
}

_COUNTERS = {
    "shards_opened": "Shards opened for reading.",
    "shards_completed": "Shards read to their end.",
    "samples": "Samples (or Arrow rows, or packed sequences) handed out.",
    "errors_skipped": 'Bad shards and samples skipped under on_error="warn".',
    "requests": "Requests (GETs) sent to an object store.",
    "retries": "Requests or bodies retried.",
    "resumed_bodies": "Bodies resumed mid-way with a Range request.",
    "cache_hits": "Shards or ranges read from a cached copy (cache_dir).",
}

_SECONDS = {
    "pipeline_ns": (
        "pipeline_seconds",
        "Time the pipeline threads ran (the sum of storage_wait, parse, decode and output_wait).",
    ),
    "decode_busy_ns": (
        "decode_busy_seconds",
        "Decoding time summed over the threads that decode.",
    ),
}

_GAUGES = {
    "read_ahead_bytes": "Bytes fetched from storage and not yet parsed.",
    "read_ahead_peak_bytes": "Most bytes one read-ahead held in ranged parts at once.",
    "output_queue_samples": "Samples queued between the pipeline threads and next().",
}


def window(now: Mapping[str, int], since: Mapping[str, int] | None) -> dict[str, int]:
    """The counters ``now`` less those of ``since`` (the last reset), levels
    as they are now."""
    if since is None:
        return dict(now)
    return {
        name: value if name in LEVELS else value - since.get(name, 0) for name, value in now.items()
    }


def _labels(labels: Mapping[str, str], **more: str) -> str:
    pairs = {**labels, **more}
    if not pairs:
        return ""
    inner = ",".join(f'{name}="{_escape(value)}"' for name, value in pairs.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def exposition(streams: Sequence[tuple[Mapping[str, str], Mapping[str, int]]]) -> str:
    """The Prometheus text exposition (format 0.0.4) of the counters of
    ``streams``, each ``(labels, stats)``: one ``# HELP`` and ``# TYPE`` per
    metric, then a sample per stream (and per stage or byte kind)."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {_number(value)}" for labels, value in samples)

    for key, help_text in _COUNTERS.items():
        metric(
            f"shardstream_{key}_total",
            "counter",
            help_text,
            [(_labels(labels), stats.get(key, 0)) for labels, stats in streams],
        )
    metric(
        "shardstream_stage_seconds_total",
        "counter",
        "Time per pipeline stage: storage_wait (waiting for bytes), parse, decode (Rust "
        "decoders), transform (the Python transform), handoff (to Python objects), "
        "output_wait (the pipeline waiting for the consumer) and next_wait (next() "
        "waiting for the pipeline).",
        [
            (_labels(labels, stage=stage), stats.get(key, 0) / 1e9)
            for labels, stats in streams
            for stage, key in STAGE_TIMES.items()
        ],
    )
    for key, (name, help_text) in _SECONDS.items():
        metric(
            f"shardstream_{name}_total",
            "counter",
            help_text,
            [(_labels(labels), stats.get(key, 0) / 1e9) for labels, stats in streams],
        )
    metric(
        "shardstream_stage_bytes_total",
        "counter",
        "Bytes per stage: storage (read from storage), cache (read from cache_dir), "
        "parse (taken by the format parsers), decode (through the field decoders).",
        [
            (_labels(labels, stage=stage), stats.get(key, 0))
            for labels, stats in streams
            for stage, key in _STAGE_BYTES.items()
        ],
    )
    for key, help_text in _GAUGES.items():
        metric(
            f"shardstream_{key}",
            "gauge",
            help_text,
            [(_labels(labels), stats.get(key, 0)) for labels, stats in streams],
        )
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value))

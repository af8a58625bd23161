"""Per-stage telemetry: the stage times and bytes of ``stats()``, its
``reset=True`` windows, workers (forked or spawned) adding to the parent's
counters, and the Prometheus text exposition of ``stats_text()``."""

from __future__ import annotations

import math
import re
import time

import pytest
from _shardtest import assert_exactly_once
from torch.utils.data import DataLoader

from shardstream import Mix, StreamingDataset

STAGES = ("storage_wait", "parse", "decode", "transform", "handoff", "output_wait", "next_wait")


def slow_transform(sample):
    time.sleep(0.005)
    return sample


def test_an_epoch_counts_time_and_bytes_per_stage(dataset):
    ds = StreamingDataset(dataset.spec, count_samples=False, shuffle_buffer=0)
    keys = [s["__key__"] for s in ds]
    assert_exactly_once(keys, dataset.keys)
    stats = ds.stats()
    # Whole local shards: the parsers take every byte read.
    assert stats["parsed_bytes"] == stats["bytes_read"] == sum(dataset.sizes)
    assert stats["pipeline_ns"] > 0 and stats["parse_ns"] > 0
    assert stats["handoff_ns"] > 0
    # The first next() waits for the pipeline thread to start.
    assert stats["next_wait_ns"] > 0
    # The pipeline's time is the sum of its stages.
    parts = ("storage_wait_ns", "decode_ns", "output_wait_ns", "parse_ns")
    assert sum(stats[p] for p in parts) == stats["pipeline_ns"]
    # Nothing decoded, no transform; the queues are empty at the end.
    assert stats["decoded_bytes"] == stats["decode_busy_ns"] == stats["transform_ns"] == 0
    assert stats["output_queue_samples"] == stats["read_ahead_bytes"] == 0


def test_decoding_and_transform_are_timed(dataset):
    ds = StreamingDataset(dataset.spec, decode=True, transform=slow_transform)
    count = sum(1 for _ in ds)
    stats = ds.stats()
    assert stats["decoded_bytes"] > 0
    assert stats["decode_ns"] > 0 and stats["decode_busy_ns"] > 0
    # 5 ms of sleep per sample, counted as the transform's.
    assert stats["transform_ns"] >= count * 5_000_000


def test_a_slow_consumer_shows_as_the_pipeline_waiting_on_output(tar_factory):
    # 48 samples of 300 KB: groups to next() close at 1 MiB (4 samples), and
    # the queue holds 4 groups, so it is full long before the shard ends,
    # whatever the timing (a dataset smaller than the queue may never fill it).
    member = bytes(range(256)) * 1200
    shard = tar_factory("big.tar", [(f"{i:03d}.bin", member) for i in range(48)])
    ds = StreamingDataset(str(shard), shuffle_buffer=0)
    spent = 0.0
    count = 0
    for sample in ds:
        assert sample["bin"] == member
        count += 1
        started = time.perf_counter()
        time.sleep(0.02)
        spent += time.perf_counter() - started
    assert count == 48
    stats = ds.stats()
    # Once the queue to next() is full, the pipeline waits on the consumer;
    # next() itself waits only for the first samples.
    assert stats["output_wait_ns"] >= 0.1 * spent * 1e9
    assert stats["next_wait_ns"] < stats["output_wait_ns"]


def test_forked_workers_add_to_the_parents_counters(dataset):
    ds = StreamingDataset(dataset.spec, shuffle_buffer=0, transform=slow_transform)
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=list)
    count = sum(len(batch) for batch in loader)
    stats = ds.stats()
    assert stats["samples"] == count == len(dataset.samples)
    assert stats["pipeline_ns"] > 0 and stats["handoff_ns"] > 0
    assert stats["transform_ns"] >= count * 5_000_000


def test_reset_returns_the_window_since_the_last_reset(dataset):
    ds = StreamingDataset(dataset.spec, count_samples=False)
    assert ds.stats(reset=True)["samples"] == 0
    sum(1 for _ in ds)
    first = ds.stats(reset=True)
    assert first["samples"] == len(dataset.samples)
    assert ds.stats(reset=True)["samples"] == 0
    ds.set_epoch(1)
    sum(1 for _ in ds)
    second = ds.stats(reset=True)
    assert second["samples"] == len(dataset.samples)
    assert second["bytes_read"] == first["bytes_read"] == sum(dataset.sizes)
    # Without reset: the window since the last reset, not moved.
    assert ds.stats()["samples"] == ds.stats()["samples"] == 0
    total = ds._counters.snapshot()
    assert total["samples"] == 2 * len(dataset.samples)
    assert 0 < second["pipeline_ns"] < total["pipeline_ns"]


# The text format, version 0.0.4:
# https://prometheus.io/docs/instrumenting/exposition_formats/
METRIC_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\["\\n])*"'
SAMPLE = re.compile(
    rf"^(?P<name>{METRIC_NAME})(?:\{{(?P<labels>{LABEL}(?:,{LABEL})*)?\}})? (?P<value>\S+)$"
)
COMMENT = re.compile(rf"^# (?P<kind>HELP|TYPE) (?P<name>{METRIC_NAME}) (?P<rest>.*)$")


def parse_exposition(text: str) -> dict[str, dict]:
    """Parses the text format by its grammar: every sample's metric has
    one ``# HELP`` and one ``# TYPE`` before its samples, which are
    contiguous; returns ``{name: {"type", "help", "samples": {labels: value}}}``."""
    assert text.endswith("\n")
    metrics: dict[str, dict] = {}
    current = None
    for line in text[:-1].split("\n"):
        comment = COMMENT.match(line)
        if comment:
            name = comment["name"]
            entry = metrics.setdefault(name, {"samples": {}})
            key = comment["kind"].lower()
            assert key not in entry, f"a second {key} for {name}"
            assert not entry["samples"], f"{key} of {name} after its samples"
            entry[key] = comment["rest"]
            current = name
            continue
        sample = SAMPLE.match(line)
        assert sample, f"not a sample line: {line!r}"
        name = sample["name"]
        assert name == current, f"{name}'s samples are not after its HELP and TYPE"
        entry = metrics[name]
        assert entry.get("type") in ("counter", "gauge"), line
        assert entry.get("help"), line
        key = tuple(
            re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', sample["labels"] or "")
        )
        assert key not in entry["samples"], f"{line!r} twice"
        value = float(sample["value"])
        assert math.isfinite(value) and value >= 0
        entry["samples"][key] = value
    for name, entry in metrics.items():
        if entry["type"] == "counter":
            assert name.endswith("_total"), name
    return metrics


def test_stats_text_is_the_prometheus_text_format_of_the_stats(dataset):
    ds = StreamingDataset(dataset.spec, decode=True, transform=slow_transform)
    sum(1 for _ in ds)
    stats = ds.stats()
    metrics = parse_exposition(ds.stats_text())
    assert metrics["shardstream_samples_total"]["samples"] == {(): stats["samples"]}
    assert metrics["shardstream_samples_total"]["type"] == "counter"
    stage_seconds = metrics["shardstream_stage_seconds_total"]["samples"]
    assert {dict(k)["stage"] for k in stage_seconds} == set(STAGES)
    for stage in STAGES:
        assert stage_seconds[(("stage", stage),)] == stats[f"{stage}_ns"] / 1e9
    assert stage_seconds[(("stage", "transform"),)] > 0
    stage_bytes = metrics["shardstream_stage_bytes_total"]["samples"]
    assert stage_bytes[(("stage", "storage"),)] == stats["bytes_read"]
    assert stage_bytes[(("stage", "decode"),)] == stats["decoded_bytes"] > 0
    assert metrics["shardstream_output_queue_samples"]["type"] == "gauge"
    # A window: after a reset, the counters start again from 0.
    ds.stats(reset=True)
    again = parse_exposition(ds.stats_text())
    assert again["shardstream_samples_total"]["samples"] == {(): 0}


def test_mix_stats_text_labels_each_stream(dataset, small_dataset):
    mix = Mix(
        [StreamingDataset(dataset.spec), StreamingDataset(small_dataset.spec)],
        weights=[1, 1],
    )
    sum(1 for _ in mix)
    counts = [s["samples"] for s in mix.stats(reset=True)]
    metrics = parse_exposition(mix.stats_text())
    samples = metrics["shardstream_samples_total"]["samples"]
    assert set(samples) == {(("stream", "0"),), (("stream", "1"),)}
    assert all(value == 0 for value in samples.values())
    assert sum(counts) > 0


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spawned_workers_add_to_the_parents_counters(dataset, context):
    """Workers started with spawn or forkserver count in the main process's
    counters as forked ones do: the counters' memory is handed to them."""
    ds = StreamingDataset(dataset.spec, shuffle_buffer=0)
    loader = DataLoader(
        ds, batch_size=4, num_workers=2, collate_fn=list, multiprocessing_context=context
    )
    count = sum(len(batch) for batch in loader)
    stats = ds.stats()
    assert stats["samples"] == count == len(dataset.samples)
    assert stats["shards_completed"] == len(dataset.paths)
    assert stats["pipeline_ns"] > 0 and stats["bytes_read"] > 0

"""Options are defined once, in the Rust core, and checked when the dataset
is constructed: every bad value is refused at once with an error naming the
option (``test_option_drift`` holds the typed faces to the definition)."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest

import shardstream
from shardstream import _core


def test_dataset_signature_keeps_only_slot_arguments_and_passes_options_through():
    params = inspect.signature(shardstream.StreamingDataset.__init__).parameters
    explicit = [p for p in params if p not in ("self", "urls", "options")]
    assert explicit == ["rank", "world_size", "num_workers", "worker_id"]
    assert params["options"].kind is inspect.Parameter.VAR_KEYWORD


def test_s3_config_defaults_match_core():
    fields = {f.name: f.default for f in dataclasses.fields(shardstream.S3Config)}
    assert fields == _core.default_s3_options()


def test_options_round_trip_through_pickle():
    options = _core.Options(seed=7, decode={"jpg": "rgb8"}, manifest=False)
    again = pickle.loads(pickle.dumps(options))
    assert again.to_dict() == options.to_dict()
    assert again["seed"] == 7 and again["manifest"] is False
    assert again["shuffle_buffer"] == _core.default_options()["shuffle_buffer"]


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"shuffle_buffer": "1000"}, TypeError, ["shuffle_buffer", "an int", "'1000'"]),
        ({"shuffle_buffer": -1}, ValueError, ["shuffle_buffer"]),
        ({"shuffle_buffer": 1 << 40}, ValueError, ["shuffle_buffer", "at most"]),
        ({"batch_size": "32"}, TypeError, ["batch_size", "an int"]),
        ({"batch_size": 0}, ValueError, ["batch_size", "at least 1"]),
        ({"decode": "pil"}, TypeError, ["decode", "dict"]),
        ({"decode": {"jpg": "pil"}}, ValueError, ["decode", "jpg", "rgb8"]),
        ({"seed": None}, TypeError, ["seed", "an int"]),
        ({"seed": 1.5}, TypeError, ["seed"]),
        ({"seed": -1}, ValueError, ["seed"]),
        ({"shuffle_shards": 1}, TypeError, ["shuffle_shards", "True or False"]),
        ({"on_error": "ignore"}, ValueError, ["on_error", "raise", "warn"]),
        ({"remainder": "keep"}, ValueError, ["remainder", "drop", "pad"]),
        ({"format": "zip"}, ValueError, ["format", "parquet"]),
        ({"batch_format": "pandas"}, ValueError, ["batch_format", "arrow"]),
        ({"io_timeout": 0}, ValueError, ["io_timeout"]),
        ({"io_timeout": 1e30}, ValueError, ["io_timeout"]),
        ({"io_timeout": "10"}, TypeError, ["io_timeout", "seconds"]),
        ({"read_ahead_bytes": 1 << 61}, ValueError, ["read_ahead_bytes", "at most"]),
        ({"read_ahead_bytes": 0}, ValueError, ["read_ahead_bytes"]),
        ({"columns": "a"}, TypeError, ["columns", "list"]),
        ({"manifest": 3}, TypeError, ["manifest"]),
        ({"manifest": ""}, ValueError, ["manifest", "an empty path"]),
        ({"s3": {"part_size": "8M"}}, TypeError, ["s3.part_size"]),
        ({"s3": {"colour": 1}}, TypeError, ["colour", "endpoint_url"]),
        ({"s3": 5}, TypeError, ["s3", "S3Config"]),
        ({"local_bytes_by_reference": None}, TypeError, ["local_bytes_by_reference"]),
        ({"read_next_epoch_early": 1}, TypeError, ["read_next_epoch_early"]),
        ({"sample_ids": 1}, TypeError, ["sample_ids"]),
        ({"sample_ids": None}, TypeError, ["sample_ids"]),
        ({"worker_shared_memory_bytes": -1}, ValueError, ["worker_shared_memory_bytes"]),
        ({"worker_shared_memory_bytes": True}, TypeError, ["worker_shared_memory_bytes", "int"]),
        ({"transform": "upper"}, TypeError, ["transform", "a callable or None", "'upper'"]),
        ({"shuffle_bufer": 10}, TypeError, ["shuffle_bufer", "shuffle_buffer"]),
        ({"model_parallel_size": 0}, ValueError, ["model_parallel_size", "at least 1"]),
        ({"model_parallel_size": 2.0}, TypeError, ["model_parallel_size", "an int"]),
        ({"model_parallel_size": 2, "world_size": 3}, ValueError, ["model_parallel_size", "3"]),
        ({"cache_dir": 5}, TypeError, ["cache_dir", "a path"]),
        ({"cache_dir": "/proc/shardstream-cache"}, ValueError, ["cache_dir", "cannot create"]),
        ({"cache_limit_bytes": 0, "cache_dir": "/tmp"}, ValueError, ["cache_limit_bytes"]),
        ({"cache_limit_bytes": 1 << 30}, ValueError, ["cache_limit_bytes", "cache_dir"]),
    ],
)
def test_bad_options_are_refused_at_construction(dataset, options, error, words):
    with pytest.raises(error) as raised:
        shardstream.StreamingDataset(dataset.spec, **options)
    message = str(raised.value)
    for word in words:
        assert word in message, (word, message)


SECRET = "Bearer s3cr3t-t0ken"


@pytest.mark.parametrize(
    "headers",
    [
        [("Authorization", SECRET)],
        (("Authorization", SECRET),),
        f"Authorization: {SECRET}",
        {("Authorization", SECRET): "x"},
    ],
    ids=["pairs", "tuple-of-pairs", "header-line", "tuple-key"],
)
def test_http_headers_of_the_wrong_type_are_refused_without_their_values(dataset, headers):
    with pytest.raises(TypeError) as raised:
        shardstream.StreamingDataset(dataset.spec, http_headers=headers)
    message = str(raised.value)
    assert "invalid option http_headers" in message and "a dict" in message, message
    assert "s3cr3t" not in message, message


def test_arrow_batches_of_tar_shards_are_refused_at_construction(dataset):
    with pytest.raises(ValueError, match=r"batch_format.*not a Parquet file"):
        shardstream.StreamingDataset(dataset.spec, batch_format="arrow", shuffle_buffer=0)


def test_bad_slot_arguments_are_refused_at_construction(dataset):
    with pytest.raises(TypeError, match="rank"):
        shardstream.StreamingDataset(dataset.spec, rank="0", world_size=2)
    for slot, name in [
        ({"world_size": 0}, "world_size"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"rank": -1}, "rank"),
        ({"num_workers": 0}, "num_workers"),
        ({"worker_id": 3, "num_workers": 3}, "worker_id"),
        # Without the layout, bounded by the largest there can be (before,
        # these passed and iterating raised a bare OverflowError).
        ({"rank": 1 << 64}, "rank"),
        ({"rank": 1 << 20}, "rank"),
        ({"worker_id": 1 << 64}, "worker_id"),
    ]:
        with pytest.raises(ValueError, match=f"invalid option {name}"):
            shardstream.StreamingDataset(dataset.spec, **slot)
    with pytest.raises(TypeError, match="urls"):
        shardstream.StreamingDataset(42)  # type: ignore[arg-type]


def test_several_ranks_count_local_tar_shards_for_equal_ranks(uneven_dataset):
    """No manifest, two ranks: the shards are counted from their headers at
    construction and both ranks get the same number of samples (before, the
    ranks got different counts and DDP hung at the epoch's end)."""
    total = len(uneven_dataset.keys)
    per_rank = []
    for rank in range(2):
        ds = shardstream.StreamingDataset(
            uneven_dataset.spec, rank=rank, world_size=2, manifest=False, seed=4
        )
        assert ds.shard_list.counted
        assert len(ds) == total // 2
        per_rank.append([s["__key__"] for s in ds])
    assert [len(keys) for keys in per_rank] == [total // 2] * 2
    union = per_rank[0] + per_rank[1]
    assert len(set(union)) == len(union) and set(union) <= set(uneven_dataset.keys)
    # One rank needs no counts: shards are dealt whole, as before.
    single = shardstream.StreamingDataset(uneven_dataset.spec, manifest=False)
    assert not single.shard_list.counted and single.shard_list.sample_counts is None
    # count_samples=False with several ranks is refused at once.
    with pytest.raises(shardstream.DatasetSpecError, match="shardstream index"):
        shardstream.StreamingDataset(
            uneven_dataset.spec, rank=0, world_size=2, manifest=False, count_samples=False
        )

"""``shardstream.grain.StreamSource`` with the real ``grain`` package: ranks
split each epoch exactly once, Grain checkpoints (``get_state`` as JSON)
resume exactly at any step, with and without ``mp_prefetch`` processes, and
Grain's own batching and packing run after it, over a ``StreamingDataset``
and a ``Mix``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np
import pytest
from _shardtest import assert_exactly_once, write_uneven_dataset

import shardstream
from shardstream.grain import StreamSource

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SEED = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """86 samples in uneven shards."""
    return write_uneven_dataset(tmp_path_factory.mktemp("grain"))


def dataset(info: Any, **slot: Any) -> shardstream.StreamingDataset:
    return shardstream.StreamingDataset(info.spec, seed=SEED, shuffle_buffer=8, **slot)


def key_of(sample: dict[str, Any]) -> str:
    return sample["__key__"]


def keys(source: Any, workers: int = 0) -> grain.IterDataset:
    """The pipeline of the tests: the sample keys, from ``workers`` processes."""
    pipeline = source.map(key_of)
    if workers:
        pipeline = pipeline.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return pipeline


def test_ranks_split_every_epoch_exactly_once(data):
    """2 simulated ranks: each epoch (``set_epoch``, a new iterator) the two
    sources read disjoint samples that make up the dataset, in equal
    numbers; the next epoch is another order, the same epoch again the
    same."""
    sources = [StreamSource(dataset(data, rank=r, world_size=2)) for r in range(2)]
    epochs = []
    for epoch in (0, 1, 1):
        for source in sources:
            source.set_epoch(epoch)
        per_rank = [list(keys(source)) for source in sources]
        assert len(per_rank[0]) == len(per_rank[1])
        assert_exactly_once(per_rank[0] + per_rank[1], data.keys)
        epochs.append(per_rank)
    assert epochs[0] != epochs[1] and epochs[1] == epochs[2]


@pytest.mark.parametrize(
    ("workers", "at"),
    [(0, 0), (0, 1), (0, 37), (0, 85), (0, 86), (2, 0), (2, 37), (2, 86)],
)
def test_a_grain_checkpoint_resumes_exactly(data, workers: int, at: int):
    """``get_state`` after ``at`` samples, through JSON, into a new pipeline
    (``set_state``): the rest of the uninterrupted epoch, in order, with
    the same number of Grain processes."""
    full = list(keys(StreamSource(dataset(data)), workers))
    assert sorted(full) == sorted(data.keys)
    iterator = iter(keys(StreamSource(dataset(data)), workers))
    taken = [next(iterator) for _ in range(at)]
    state = json.loads(json.dumps(iterator.get_state()))
    resumed = iter(keys(StreamSource(dataset(data)), workers))
    resumed.set_state(state)
    assert taken + list(resumed) == full


def test_mp_prefetch_processes_read_disjoint_slots(data):
    """``mp_prefetch`` with 3 processes: each takes a worker slot of the
    plan, together every sample once; epoch 1 is another order."""
    source = StreamSource(dataset(data))
    first = list(keys(source, 3))
    source.set_epoch(1)
    second = list(keys(source, 3))
    assert_exactly_once(first, data.keys)
    assert_exactly_once(second, data.keys)
    assert first != second


def test_grain_batches_and_packs_after_the_source(data):
    """Grain's ``batch`` and ``FirstFitPackIterDataset`` over the samples'
    bytes: every sample's bytes end up in a batch once."""

    def as_tokens(sample: dict[str, Any]) -> dict[str, Any]:
        body = b"".join(v for k, v in sorted(sample.items()) if not k.startswith("__"))
        return {"tokens": np.frombuffer(body[:40] or b"\0", dtype=np.uint8).astype(np.int32)}

    source = StreamSource(dataset(data)).map(as_tokens)
    packed = grain.experimental.FirstFitPackIterDataset(
        source, length_struct={"tokens": 64}, num_packing_bins=4, shuffle_bins=False
    ).batch(2)
    batches = list(packed)
    assert all(b["tokens"].shape[1:] == (64,) for b in batches)
    # Every document once: its segment ids count the documents per row.
    documents = sum(int(row.max()) for b in batches for row in b["tokens_segment_ids"])
    assert documents == len(data.keys)
    batched = StreamSource(dataset(data)).batch(8, batch_fn=lambda xs: [key_of(x) for x in xs])
    counted = list(batched)
    assert_exactly_once([k for batch in counted for k in batch], data.keys)


def test_a_mix_is_a_source_too(data, tmp_path_factory):
    """A ``Mix`` as the source: a Grain checkpoint resumes it exactly, with
    and without processes."""
    other = write_uneven_dataset(tmp_path_factory.mktemp("grain-other"), (7, 9), prefix="o")

    def mix() -> shardstream.Mix:
        a, b = dataset(data), dataset(other)
        return shardstream.Mix([a, b], [0.6, 0.4], policy="stop", seed=7)

    for workers in (0, 2):
        full = list(keys(StreamSource(mix()), workers))
        assert full == list(keys(StreamSource(mix()), workers)) and len(full) > 20
        iterator: Iterator[str] = iter(keys(StreamSource(mix()), workers))
        taken = [next(iterator) for _ in range(len(full) // 2)]
        state = json.loads(json.dumps(iterator.get_state()))  # type: ignore[attr-defined]
        resumed = iter(keys(StreamSource(mix()), workers))
        resumed.set_state(state)
        assert taken + list(resumed) == full


def test_a_source_takes_only_shardstream_datasets_and_worker_slices(data):
    with pytest.raises(TypeError, match="StreamSource takes a shardstream StreamingDataset"):
        StreamSource([1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one worker slot"):
        StreamSource(dataset(data)).set_slice(slice(0, 10, 2))


@pytest.mark.parametrize("new_workers", [0, 3])
def test_a_grain_checkpoint_resumes_elastically_onto_other_processes(data, new_workers: int):
    """The state of a pipeline of 2 Grain processes, 37 samples in, given
    to ``shardstream.elastic_state`` and loaded into the dataset of a
    pipeline of ``new_workers`` processes: every sample not yet taken comes
    once (elastic resume needs sample counts)."""
    iterator = iter(keys(StreamSource(dataset(data, count_samples=True)), 2))
    taken = [next(iterator) for _ in range(37)]
    state = json.loads(json.dumps(iterator.get_state()))
    resumed = dataset(data, count_samples=True)
    resumed.load_state_dict(shardstream.elastic_state(state))
    rest = list(keys(StreamSource(resumed), new_workers))
    assert_exactly_once(taken + rest, data.keys)

"""The torchdata.nodes recipe of docs/torchdata.md: ``IterableWrapper`` over
each ``StreamingDataset``, ``MultiNodeWeightedSampler`` mixing two of them,
a threaded ``ParallelMapper``, a ``Batcher`` and a ``Loader``, with exact
resume from ``Loader.state_dict()``."""

from __future__ import annotations

from pathlib import Path

import pytest
from _shardtest import assert_exactly_once, slot_states, write_uneven_dataset
from torchdata.nodes import (
    Batcher,
    IterableWrapper,
    Loader,
    MultiNodeWeightedSampler,
    ParallelMapper,
    StopCriteria,
)

import shardstream

BATCH = 4


@pytest.fixture(scope="module")
def other_dataset(tmp_path_factory):
    """A second, smaller dataset (27 samples in 3 shards)."""
    root = tmp_path_factory.mktemp("other")
    return write_uneven_dataset(root, (9, 14, 4), prefix="other", seed=1)


def name(sample) -> str:
    """The map function: which dataset and sample."""
    return f"{Path(sample['__url__']).stem.split('-')[0]}/{sample['__key__']}"


def pipeline(a, b, stop: str) -> Loader:
    """The recipe: two datasets mixed 3:1, mapped in threads, batched."""
    sources = {
        "a": IterableWrapper(shardstream.StreamingDataset(a.spec, seed=1, shuffle_buffer=7)),
        "b": IterableWrapper(shardstream.StreamingDataset(b.spec, seed=2, shuffle_buffer=5)),
    }
    node = MultiNodeWeightedSampler(sources, {"a": 0.75, "b": 0.25}, stop_criteria=stop, seed=9)
    node = ParallelMapper(node, name, num_workers=2, method="thread")
    return Loader(Batcher(node, batch_size=BATCH, drop_last=False))


def all_names(a, b) -> list[str]:
    return [f"part/{k}" for k in a.keys] + [f"other/{k}" for k in b.keys]


def resumed(a, b, stop: str, k: int) -> tuple[list[list[str]], list[list[str]]]:
    """The first ``k`` batches, and the rest from a new loader given the state after them."""
    loader = pipeline(a, b, stop)
    iterator = iter(loader)
    prefix = [next(iterator) for _ in range(k)]
    state = loader.state_dict()
    # Each dataset's own exact state, not a count of items to skip again.
    assert len(slot_states(state)) == 2
    del iterator, loader
    again = pipeline(a, b, stop)
    again.load_state_dict(state)
    return prefix, list(again)


@pytest.mark.parametrize("k", [1, 9, 20])
def test_weighted_mixture_resumes_exactly(uneven_dataset, other_dataset, k):
    full = list(pipeline(uneven_dataset, other_dataset, StopCriteria.ALL_DATASETS_EXHAUSTED))
    names = [n for batch in full for n in batch]
    assert_exactly_once(names, all_names(uneven_dataset, other_dataset))
    # The mixture interleaves: the smaller dataset is not all at the end.
    first_half = names[: len(names) // 2]
    assert 0 < sum(n.startswith("other/") for n in first_half) < len(first_half)
    prefix, rest = resumed(uneven_dataset, other_dataset, StopCriteria.ALL_DATASETS_EXHAUSTED, k)
    assert prefix == full[:k]
    assert prefix + rest == full


def test_cycling_mixture_resumes_exactly_after_a_dataset_restarts(uneven_dataset, other_dataset):
    """With the default stop criterion the smaller dataset starts its next
    epoch (a new shard order) before the larger one ends; a resume after
    that point still gives exactly the uninterrupted rest."""
    stop = StopCriteria.CYCLE_UNTIL_ALL_DATASETS_EXHAUSTED
    full = list(pipeline(uneven_dataset, other_dataset, stop))
    names = [n for batch in full for n in batch]
    others = [n for n in names if n.startswith("other/")]
    assert len(others) > len(other_dataset.keys)  # it cycled
    assert (
        others[: len(other_dataset.keys)]
        != others[len(other_dataset.keys) :][: len(other_dataset.keys)]
    )
    k = len(full) - 3
    prefix, rest = resumed(uneven_dataset, other_dataset, stop, k)
    assert prefix + rest == full


def test_each_pass_over_the_loader_is_the_next_epoch(uneven_dataset, other_dataset):
    loader = pipeline(uneven_dataset, other_dataset, StopCriteria.ALL_DATASETS_EXHAUSTED)
    first = [n for batch in loader for n in batch]
    second = [n for batch in loader for n in batch]
    assert_exactly_once(first, all_names(uneven_dataset, other_dataset))
    assert_exactly_once(second, all_names(uneven_dataset, other_dataset))
    assert first != second

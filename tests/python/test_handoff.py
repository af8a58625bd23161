"""The hand-off of samples to Python: the `str` objects shared between the
dicts of one stream, and a state saved after any number of samples handed
out resumes after exactly that many (samples already received but not yet
handed out are not counted)."""

from __future__ import annotations

import sys

import pytest
from _shardtest import DatasetInfo

import shardstream

SEED, SHUFFLE = 3, 5


def test_dicts_share_the_url_and_field_name_strs(dataset: DatasetInfo) -> None:
    ds = shardstream.StreamingDataset(dataset.spec, shuffle_buffer=0, shuffle_shards=False)
    got = list(ds)
    assert [s["__key__"] for s in got] == dataset.keys
    assert [s["__url__"] for s in got] == [s.url for s in dataset.samples]
    for sample, expected in zip(got, dataset.samples, strict=True):
        assert list(sample) == ["__key__", "__url__", *expected.fields]
        assert {k: v for k, v in sample.items() if not k.startswith("__")} == expected.fields
        for name in sample:
            assert sys.intern(name) is name
    by_url: dict[str, list[int]] = {}
    for sample in got:
        by_url.setdefault(sample["__url__"], []).append(id(sample["__url__"]))
    assert len(by_url) == len(dataset.paths) > 1
    for ids in by_url.values():
        # One object for the samples of a shard (they are all alive here).
        assert len(set(ids)) == 1


def test_batches_share_the_url_strs(dataset: DatasetInfo) -> None:
    ds = shardstream.StreamingDataset(
        dataset.spec, shuffle_buffer=0, shuffle_shards=False, batch_size=5
    )
    batches = list(ds)
    urls = [u for b in batches for u in b["__url__"]]
    assert urls == [s.url for s in dataset.samples]
    assert [k for b in batches for k in b["__key__"]] == dataset.keys
    objects: dict[str, set[int]] = {}
    for batch in batches:
        for url in batch["__url__"]:
            objects.setdefault(url, set()).add(id(url))
    assert all(len(ids) == 1 for ids in objects.values())


@pytest.mark.parametrize("batch_size", [None, 3])
def test_state_after_each_item_resumes_after_exactly_it(
    uneven_dataset: DatasetInfo, batch_size: int | None
) -> None:
    def make() -> shardstream.StreamingDataset:
        return shardstream.StreamingDataset(
            uneven_dataset.spec, seed=SEED, shuffle_buffer=SHUFFLE, batch_size=batch_size
        )

    def keys(item) -> list[str]:
        key = item["__key__"]
        return key if isinstance(key, list) else [key]

    ds = make()
    items, states = [], [ds.state_dict()]
    for item in ds:
        items.append(keys(item))
        states.append(ds.state_dict())
    flat = [k for ks in items for k in ks]
    assert sorted(flat) == sorted(uneven_dataset.keys)
    for k, state in enumerate(states):
        assert state["produced"] == sum(len(ks) for ks in items[:k])
    for k in sorted({0, 1, 2, len(items) // 2, len(items) - 1, len(items)}):
        resumed = make()
        resumed.load_state_dict(states[k])
        assert [keys(item) for item in resumed] == items[k:], k

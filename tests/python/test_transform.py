"""``transform=``: applied in the process that iterates (DataLoader workers
included), to each sample or each Rust batch; its errors name the shard and
key and follow ``on_error``; exact and elastic resume stay exact; ``spawn``
workers need it picklable."""

from __future__ import annotations

import gc
import json
import os
import re
import time
import warnings

import numpy as np
import pytest
from _shardtest import (
    REPO_ROOT,
    assert_exactly_once,
    collect,
    keys_of,
    loader,
    slot_states,
)
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import shardstream
from shardstream import SampleSkippedWarning, ShardStreamError, TransformError

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

SEED, SHUFFLE, BATCH = 3, 7, 4


def summarise(sample):
    """A module-level (picklable) transform: the key, the text's length,
    the label and the process it ran in."""
    return {
        "key": sample["__key__"],
        "url": sample["__url__"],
        "length": len(sample["txt"]),
        "label": int(sample["cls"]),
        "pid": os.getpid(),
    }


def fails_on_fives(sample):
    """Raises on every sample whose label is 5 (one in ten)."""
    if int(sample["cls"]) == 5:
        raise ValueError(f"label five in {sample['__key__']}")
    return sample["__key__"]


def batch_keys(batch):
    """A transform of Rust batches: their keys, joined."""
    return "|".join(batch["__key__"])


def label_of(info, key: str) -> int:
    """A sample's label, as the fixture wrote it (``index % 10``)."""
    return int(key.split("-")[1]) % 10


def dataset(info, **options):
    options = {"seed": SEED, "shuffle_buffer": SHUFFLE, "transform": summarise, **options}
    return shardstream.StreamingDataset(info.spec, **options)


def test_transform_runs_in_the_dataloader_workers(uneven_dataset):
    out = collect(loader(dataset(uneven_dataset), 2))
    assert_exactly_once([o["key"] for o in out], uneven_dataset.keys)
    by_key = {s.key: s for s in uneven_dataset.samples}
    for o in out:
        expected = by_key[o["key"]]
        assert o["url"] == expected.url
        assert o["length"] == len(expected.fields["txt"])
        assert o["label"] == label_of(uneven_dataset, o["key"])
    pids = {o["pid"] for o in out}
    assert len(pids) == 2 and os.getpid() not in pids


def test_transform_keeps_the_order_of_the_plan(uneven_dataset):
    plain = keys_of(collect(dataset(uneven_dataset, transform=None)))
    transformed = collect(dataset(uneven_dataset))
    assert [o["key"] for o in transformed] == plain


def test_transform_gets_rust_batches(uneven_dataset):
    ds = dataset(uneven_dataset, batch_size=BATCH, transform=batch_keys)
    joined = collect(loader(ds, 2))
    assert all(isinstance(j, str) for j in joined)
    keys = [k for j in joined for k in j.split("|")]
    assert_exactly_once(keys, uneven_dataset.keys)
    assert max(len(j.split("|")) for j in joined) == BATCH


@pytest.mark.parametrize("value", [3, "summarise", [summarise]])
def test_a_transform_that_is_not_callable_is_refused_at_construction(uneven_dataset, value):
    with pytest.raises(TypeError, match=r"invalid option transform: expected a callable or None"):
        dataset(uneven_dataset, transform=value)


def test_an_error_in_the_transform_names_the_shard_and_key(uneven_dataset):
    options = {"shuffle_buffer": 0, "shuffle_shards": False}
    order = keys_of(collect(dataset(uneven_dataset, transform=None, **options)))
    first_five = next(k for k in order if label_of(uneven_dataset, k) == 5)
    ds = dataset(uneven_dataset, transform=fails_on_fives, **options)
    got = []
    with pytest.raises(TransformError) as raised:
        for key in ds:
            got.append(key)
    shard = next(s.url for s in uneven_dataset.samples if s.key == first_five)
    message = str(raised.value)
    assert f"sample {first_five!r} of shard {shard}" in message, message
    assert "ValueError: label five in" in message
    assert isinstance(raised.value, ShardStreamError)
    assert isinstance(raised.value.__cause__, ValueError)
    assert got == order[: order.index(first_five)]
    # The exception's frames hold the stream (and so its threads): let go.
    del raised, ds
    gc.collect()


def test_an_error_in_a_worker_reaches_the_main_process(uneven_dataset):
    ds = dataset(uneven_dataset, transform=fails_on_fives)
    with pytest.raises(TransformError, match=r"transform raised on sample 'u\d\d-\d{4}' of shard"):
        collect(loader(ds, 2))


def test_an_error_in_a_batch_transform_names_the_batch(uneven_dataset):
    ds = dataset(uneven_dataset, batch_size=BATCH, transform=fails_on_fives)
    with pytest.raises(TransformError, match=r"a batch of \d samples, from sample 'u\d\d-\d{4}'"):
        collect(ds)
    del ds
    gc.collect()


def test_on_error_warn_skips_the_sample_and_counts_it(uneven_dataset):
    ds = dataset(uneven_dataset, transform=fails_on_fives, on_error="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = collect(ds)
    fives = [k for k in uneven_dataset.keys if label_of(uneven_dataset, k) == 5]
    assert fives
    assert_exactly_once(got, set(uneven_dataset.keys) - set(fives))
    skipped = [w for w in caught if issubclass(w.category, SampleSkippedWarning)]
    assert len(skipped) == len(fives)
    assert all("transform raised on sample" in str(w.message) for w in skipped)
    assert issubclass(SampleSkippedWarning, shardstream.ShardSkippedWarning)
    assert ds.stats()["errors_skipped"] == len(fives)


# --------------------------------------------------------------------------
# Resume
# --------------------------------------------------------------------------


def stateful(info, transform, **kwargs) -> StatefulDataLoader:
    ds = shardstream.StreamingDataset(
        info.spec, seed=SEED, shuffle_buffer=SHUFFLE, transform=transform, on_error="warn", **kwargs
    )
    ds.set_epoch(1)
    return StatefulDataLoader(ds, batch_size=BATCH, num_workers=2, collate_fn=list, timeout=120)


@pytest.mark.filterwarnings("ignore::shardstream.SampleSkippedWarning")
@pytest.mark.parametrize("k", [1, 7, 12])
def test_exact_resume_with_a_transform(uneven_dataset, k):
    """A transform that skips samples (under ``on_error="warn"``) does not
    shift what a resumed loader hands out."""
    full = collect(stateful(uneven_dataset, fails_on_fives))
    assert_exactly_once(
        [key for b in full for key in b],
        [key for key in uneven_dataset.keys if label_of(uneven_dataset, key) != 5],
    )
    dl = stateful(uneven_dataset, fails_on_fives)
    iterator = iter(dl)
    prefix = [next(iterator) for _ in range(k)]
    state = dl.state_dict()
    del iterator, dl
    assert prefix == full[:k]
    assert len(slot_states(state)) == 2
    resumed = stateful(uneven_dataset, fails_on_fives)
    resumed.load_state_dict(state)
    assert prefix + collect(resumed) == full


@pytest.mark.filterwarnings("ignore::shardstream.SampleSkippedWarning")
def test_elastic_resume_with_a_transform(uneven_dataset):
    """A 2-rank job of 2 workers per rank saves mid-epoch; a 3-rank job of 2
    workers per rank takes over: every not-yet-produced sample comes once,
    transformed."""
    saved, consumed, full = [], [], []
    for rank, k in [(0, 3), (1, 5)]:
        full += [
            o["key"]
            for b in collect(stateful(uneven_dataset, summarise, rank=rank, world_size=2))
            for o in b
        ]
        dl = stateful(uneven_dataset, summarise, rank=rank, world_size=2)
        iterator = iter(dl)
        consumed += [o["key"] for _ in range(k) for o in next(iterator)]
        saved.append(dl.state_dict())
        del iterator, dl
    elastic = shardstream.elastic_state(*saved)
    new = []
    for rank in range(3):
        ds = shardstream.StreamingDataset(
            uneven_dataset.spec,
            seed=SEED,
            shuffle_buffer=SHUFFLE,
            transform=summarise,
            on_error="warn",
            rank=rank,
            world_size=3,
        )
        ds.load_state_dict(elastic)
        out = collect(loader(ds, 2))
        assert all(o["pid"] != os.getpid() for o in out)
        new += [o["key"] for o in out]
    remaining = set(full) - set(consumed)
    assert len(new) == len(remaining) // 3 * 3
    assert_exactly_once(new, set(new))
    assert set(new) <= remaining


# --------------------------------------------------------------------------
# spawn workers
# --------------------------------------------------------------------------


def test_spawn_workers_run_a_module_level_transform(uneven_dataset):
    ds = dataset(uneven_dataset)
    out = collect(loader(ds, 2, multiprocessing_context="spawn"))
    assert_exactly_once([o["key"] for o in out], uneven_dataset.keys)
    assert os.getpid() not in {o["pid"] for o in out}


@pytest.mark.filterwarnings("ignore:Got pickle error:UserWarning")
def test_spawn_workers_refuse_a_lambda_at_once(uneven_dataset):
    ds = dataset(uneven_dataset, transform=lambda sample: sample["__key__"])
    assert len(collect(ds)) == len(uneven_dataset.keys)  # fine in this process
    started = time.monotonic()
    with pytest.raises(TypeError, match=r"invalid option transform: .* cannot be pickled"):
        collect(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn"))
    assert time.monotonic() - started < 30


# --------------------------------------------------------------------------
# README's recipes
# --------------------------------------------------------------------------


def readme_recipes() -> dict:
    """The functions of README's Transforms code block."""
    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index("### Transforms") :]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    namespace: dict = {}
    exec(compile(code, "README.md#transforms", "exec"), namespace)
    return namespace


def test_readme_audio_recipe_on_wav_and_json(dataset):
    audio = readme_recipes()["audio"]
    ds = shardstream.StreamingDataset(dataset.spec, decode=True, transform=audio)
    out = collect(loader(ds, 2))
    assert len(out) == len(dataset.keys)
    labels = sorted(json.loads(s.fields["json"])["label"] for s in dataset.samples)
    assert sorted(label for _, label in out) == labels
    lengths = {tuple(clip.shape) for clip, _ in out}
    assert len(lengths) == 1 and next(iter(lengths))[0] > 0  # one length: 2 s, cut or padded


def test_readme_image_recipe_on_rgb8(tmp_path):
    image = readme_recipes()["image"]
    x, label = image({"jpg": np.full((300, 180, 3), 255, np.uint8), "cls": 3})
    assert tuple(x.shape) == (3, 224, 224) and label == 3
    assert abs(float(x.min()) - 1) < 1e-5 and abs(float(x.max()) - 1) < 1e-5

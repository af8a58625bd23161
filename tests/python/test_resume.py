"""Exact resume through ``StatefulDataLoader``, elastic resume onto other
layouts, states that do not fit, and a real crash (SIGKILL) and restart of
``examples/resume.py``."""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import subprocess
import sys
from collections import Counter
from typing import Any

import jsonschema
import pytest
import torch
import torch.utils.data
from _shardtest import (
    EXAMPLES_DIR,
    UNEVEN_COUNTS,
    DatasetInfo,
    assert_exactly_once,
    collect,
    key_batch,
    keys_of,
    load_schema,
    loader,
    run_bounded,
    slot_states,
    write_uneven_dataset,
)
from torchdata.stateful_dataloader import StatefulDataLoader

import shardstream
from shardstream import StateMismatchError

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

STATE_VALIDATOR = jsonschema.Draft202012Validator(load_schema("state"))
SEED, EPOCH, BATCH, SHUFFLE = 5, 2, 4, 7
SUBPROCESS_TIMEOUT = 120


def json_round_trip(state):
    return json.loads(json.dumps(state))


def validate_states(state) -> list[dict]:
    """Every slot state inside ``state`` is valid by the schema; returns them."""
    found = slot_states(state)
    assert found, "no shardstream state inside"
    for slot in found:
        STATE_VALIDATOR.validate(slot)
    return found


# --------------------------------------------------------------------------
# Exact resume with StatefulDataLoader
# --------------------------------------------------------------------------


def make_loader(
    info: DatasetInfo, num_workers: int, manifest: bool, **kwargs
) -> StatefulDataLoader:
    kwargs = {"seed": SEED, "shuffle_buffer": SHUFFLE, **kwargs}
    epoch = kwargs.pop("epoch", EPOCH)
    ds = shardstream.StreamingDataset(info.spec, manifest=None if manifest else False, **kwargs)
    ds.set_epoch(epoch)
    assert (ds.manifest_path is not None) == manifest
    return StatefulDataLoader(
        ds,
        batch_size=BATCH,
        num_workers=num_workers,
        collate_fn=key_batch,
        timeout=120 if num_workers else 0,
    )


@pytest.fixture(scope="module")
def uninterrupted(uneven_dataset):
    """``get(num_workers, manifest, **kwargs)``: the batches of one
    uninterrupted epoch, computed once per layout."""
    cache: dict = {}

    def get(num_workers: int, manifest: bool, **kwargs) -> list[list[str]]:
        key = (num_workers, manifest, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = collect(make_loader(uneven_dataset, num_workers, manifest, **kwargs))
        return copy.deepcopy(cache[key])

    return get


def save_after(info, num_workers, manifest, k, *, at_end=False, **kwargs):
    """The first ``k`` batches and the loader's state (through JSON) after
    them; ``at_end``: the loader has also seen the epoch end."""
    dl = make_loader(info, num_workers, manifest, **kwargs)
    iterator = iter(dl)
    prefix = [next(iterator) for _ in range(k)]
    if at_end:
        assert next(iterator, None) is None
    state = json_round_trip(dl.state_dict())
    del iterator, dl
    return prefix, state


def resume_rest(info, num_workers, manifest, state, **kwargs) -> list[list[str]]:
    dl = make_loader(info, num_workers, manifest, **kwargs)
    dl.load_state_dict(state)
    return collect(dl)


POINTS = ["start", "first", "middle", "last-1", "end"]


def batches_at(point: str, n: int) -> int:
    return {"start": 0, "first": 1, "middle": n // 2, "last-1": n - 1, "end": n}[point]


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
@pytest.mark.parametrize("num_workers", [0, 2, 4])
def test_exact_resume(uneven_dataset, uninterrupted, num_workers, manifest, point):
    full = uninterrupted(num_workers, manifest)
    assert_exactly_once([k for batch in full for k in batch], uneven_dataset.keys)
    k = batches_at(point, len(full))
    prefix, state = save_after(uneven_dataset, num_workers, manifest, k)
    assert prefix == full[:k]

    slots = validate_states(state)
    assert len(slots) == max(num_workers, 1)
    assert {(s["rank"], s["worker_id"], s["num_workers"]) for s in slots} == {
        (0, w, max(num_workers, 1)) for w in range(max(num_workers, 1))
    }
    assert all(s["epoch"] == EPOCH for s in slots)
    # The states count what the loader handed out, not what workers prefetched.
    assert sum(s["produced"] for s in slots) == sum(map(len, prefix))

    rest = resume_rest(uneven_dataset, num_workers, manifest, state)
    assert prefix + rest == full


@pytest.mark.parametrize("explicit", [True, False], ids=["set_epoch", "by-itself"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_saved_after_the_epoch_ended(uneven_dataset, uninterrupted, num_workers, explicit):
    """A state saved once the loop has seen the epoch end is a finished
    iterator: ``StatefulDataLoader`` starts a new one, for the next epoch,
    whether ``set_epoch`` says so or not (a fresh dataset is at epoch 0
    until the state is loaded)."""
    full = uninterrupted(num_workers, True)
    prefix, state = save_after(uneven_dataset, num_workers, True, len(full), at_end=True)
    assert prefix == full
    assert all(s["finished"] for s in validate_states(state))
    dl = make_loader(uneven_dataset, num_workers, True, epoch=0)
    dl.load_state_dict(state)
    if explicit:
        dl.dataset.set_epoch(EPOCH + 1)
    assert collect(dl) == uninterrupted(num_workers, True, epoch=EPOCH + 1)
    assert dl.dataset.epoch == EPOCH + 2


@pytest.mark.parametrize("explicit", [True, False], ids=["set_epoch", "by-itself"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_then_next_epoch(uneven_dataset, uninterrupted, num_workers, explicit):
    """After a resumed epoch ends, the next epoch is the ordinary one."""
    prefix, state = save_after(uneven_dataset, num_workers, True, 3)
    dl = make_loader(uneven_dataset, num_workers, True, epoch=0)
    dl.load_state_dict(state)
    rest = collect(dl)
    assert prefix + rest == uninterrupted(num_workers, True)
    if explicit:
        dl.dataset.set_epoch(EPOCH + 1)
    following = collect(dl)
    assert following == uninterrupted(num_workers, True, epoch=EPOCH + 1)
    assert following != prefix + rest


@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_exact_resume_of_a_rank_with_remainder(uneven_dataset, remainder):
    kwargs = {"rank": 2, "world_size": 3, "remainder": remainder}
    dl = make_loader(uneven_dataset, 2, True, **kwargs)
    full = collect(dl)
    assert sum(map(len, full)) == len(dl.dataset)
    for k in (1, len(full) // 2):
        prefix, state = save_after(uneven_dataset, 2, True, k, **kwargs)
        assert prefix + resume_rest(uneven_dataset, 2, True, state, **kwargs) == full


def test_state_of_an_unstarted_loader(uneven_dataset, uninterrupted):
    dl = make_loader(uneven_dataset, 2, True)
    state = json_round_trip(dl.state_dict())
    assert all(s["produced"] == 0 for s in validate_states(state))
    assert resume_rest(uneven_dataset, 2, True, state) == uninterrupted(2, True)


def test_dataset_state_dict_is_a_fresh_json_dict(uneven_dataset):
    ds = shardstream.StreamingDataset(uneven_dataset.spec, seed=SEED, shuffle_buffer=SHUFFLE)
    iterator = iter(ds)
    for _ in range(10):
        next(iterator)
    first = ds.state_dict()
    assert json_round_trip(first) == first
    STATE_VALIDATOR.validate(first)
    assert first["produced"] == 10
    first["produced"] = 999
    assert ds.state_dict()["produced"] == 10


@pytest.mark.parametrize("kind", ["dataset", "mix"])
def test_a_main_process_state_while_workers_iterate_is_refused(uneven_dataset, kind):
    """A plain DataLoader's workers iterate the dataset; its main process
    does not see how far they got. Before, its state_dict() gave the next
    epoch's start, and a resume from it left out the rest of the epoch
    without a word."""

    def make() -> shardstream.StreamingDataset | shardstream.Mix:
        spec = uneven_dataset.spec
        ds = shardstream.StreamingDataset(spec, seed=SEED, shuffle_buffer=SHUFFLE)
        if kind == "mix":
            return shardstream.Mix([ds, shardstream.StreamingDataset(spec, seed=SEED)])
        return ds

    ds = make()
    name = type(ds).__name__
    assert ds.state_dict()["epoch"] == 0, "before any iteration the state is epoch 0's start"
    dl = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=2, collate_fn=list)
    batches = iter(dl)
    next(batches)
    with pytest.raises(StateMismatchError, match=rf"{name}.state_dict\(\) in a process whose"):
        ds.state_dict()
    rest = list(batches)
    assert rest, "the epoch went on"
    with pytest.raises(StateMismatchError, match=r"loader\.state_dict"):
        ds.state_dict()
    # set_epoch tells the main process where the next iteration starts.
    ds.set_epoch(1)
    state = json_round_trip(ds.state_dict())
    fresh = make()
    fresh.set_epoch(1)
    assert state == json_round_trip(fresh.state_dict())
    # An iteration in the main process knows its own progress.
    main = iter(ds)
    next(main)
    assert ds.state_dict()["epoch"] == 1


# --------------------------------------------------------------------------
# States that do not fit
# --------------------------------------------------------------------------


def test_state_of_another_seed_is_refused(uneven_dataset):
    # num_workers=0 only: a StatefulDataLoader whose workers fail while
    # resuming takes ~10 s to shut them down (torchdata, any dataset).
    _, state = save_after(uneven_dataset, 0, True, 2)
    dl = make_loader(uneven_dataset, 0, True, seed=SEED + 1)
    dl.load_state_dict(state)
    with pytest.raises(StateMismatchError, match=r"saved for other options \(seed differs\)"):
        collect(dl)


def test_a_num_workers_mismatch_through_stateful_dataloader_names_both_counts(uneven_dataset):
    """torchdata restores each worker's state in that worker, then asserts
    on the worker count with a bare AssertionError: the dataset says why
    first."""
    _, state = save_after(uneven_dataset, 2, True, 3)
    dl = make_loader(uneven_dataset, 3, True)
    dl.load_state_dict(state)
    with pytest.raises(StateMismatchError, match=r"num_workers=2.*num_workers=3") as caught:
        collect(dl)
    assert "elastic_state" in str(caught.value)


def one_slot_state(info, **kwargs) -> dict:
    kwargs = {"seed": SEED, "shuffle_buffer": SHUFFLE, **kwargs}
    ds = shardstream.StreamingDataset(info.spec, **kwargs)
    iterator = iter(ds)
    for _ in range(3):
        next(iterator)
    return ds.state_dict()


@pytest.mark.parametrize(
    "change",
    [
        {"seed": SEED + 1},
        {"shuffle_buffer": SHUFFLE + 1},
        {"shuffle_shards": False},
        {"remainder": "pad"},
        {"rank": 1},
        {"world_size": 3},
        {"num_workers": 2, "worker_id": 0},
        {"subset": True},
    ],
    ids=lambda change: ",".join(change),
)
def test_mismatching_state_fails_when_iteration_starts(uneven_dataset, change):
    base = {"rank": 0, "world_size": 2}
    state = one_slot_state(uneven_dataset, **base)
    kwargs = {"seed": SEED, "shuffle_buffer": SHUFFLE, **base, **change}
    spec = uneven_dataset.spec
    if kwargs.pop("subset", False):
        spec = [str(p) for p in uneven_dataset.paths[1:]]
    ds = shardstream.StreamingDataset(spec, **kwargs)
    ds.load_state_dict(state)  # the state itself is well formed
    with pytest.raises(StateMismatchError):
        collect(ds)


def garbage_states(good: dict) -> dict[str, object]:
    return {
        "empty": {},
        "other-dict": {"model": [1, 2, 3]},
        "format-only": {"format": "shardstream.state"},
        "other-version": dict(good, version=1),
        "unknown-field": dict(good, colour="red"),
        "missing-field": {k: v for k, v in good.items() if k != "cursor"},
        "negative-count": dict(good, produced=-1),
        "epoch-not-a-number": dict(good, epoch="two"),
        "elastic-without-slots": {"format": "shardstream.elastic", "version": 1},
        "elastic-garbage-slot": {"format": "shardstream.elastic", "version": 1, "slots": [{}]},
        "elastic-bad-slot-version": {
            "format": "shardstream.elastic",
            "version": 1,
            "slots": [dict(good, version=9)],
        },
        # Not a mapping, or not JSON data: not an AttributeError or TypeError.
        "a-list": [good],
        "a-string": json.dumps(good),
        "none": None,
        "not-json-data": dict(good, epoch=object()),
    }


GARBAGE = [
    "empty",
    "other-dict",
    "format-only",
    "other-version",
    "unknown-field",
    "missing-field",
    "negative-count",
    "epoch-not-a-number",
    "elastic-without-slots",
    "elastic-garbage-slot",
    "elastic-bad-slot-version",
    "a-list",
    "a-string",
    "none",
    "not-json-data",
]


@pytest.mark.parametrize("case", GARBAGE)
def test_garbage_state_fails_at_load(uneven_dataset, case):
    state = garbage_states(one_slot_state(uneven_dataset))[case]
    ds = shardstream.StreamingDataset(uneven_dataset.spec, seed=SEED, shuffle_buffer=SHUFFLE)
    with pytest.raises(StateMismatchError):
        ds.load_state_dict(state)
    # The dataset is still usable.
    assert_exactly_once(keys_of(collect(ds)), uneven_dataset.keys)


@pytest.mark.parametrize("slots", ["missing", None, {"0": {}}, []])
def test_an_elastic_state_without_a_list_of_slots_is_refused_naming_slots(uneven_dataset, slots):
    """Before, a missing or null ``slots`` was read as one slot's state, and
    the error named a field of that (``fingerprint``)."""
    state: dict[str, Any] = {"format": "shardstream.elastic", "version": 1}
    if slots != "missing":
        state["slots"] = slots
    for ds in (
        shardstream.StreamingDataset(uneven_dataset.spec),
        shardstream.Mix([shardstream.StreamingDataset(uneven_dataset.spec)]),
    ):
        with pytest.raises(StateMismatchError, match="state field slots: expected a list"):
            ds.load_state_dict(state)


@pytest.mark.parametrize("case", ["bad-rng", "empty-elastic"])
def test_schema_invalid_values_fail_by_the_time_iteration_starts(uneven_dataset, case):
    good = one_slot_state(uneven_dataset)
    state = (
        dict(good, rng_word_pos="twelve")
        if case == "bad-rng"
        else {"format": "shardstream.elastic", "version": 1, "slots": []}
    )
    assert not STATE_VALIDATOR.is_valid(state)
    ds = shardstream.StreamingDataset(uneven_dataset.spec, seed=SEED, shuffle_buffer=SHUFFLE)
    with pytest.raises(StateMismatchError):  # at load or when iteration starts
        ds.load_state_dict(state)
        collect(ds)


# --------------------------------------------------------------------------
# Damaged states: every field is checked against the dataset and the plan
# before anything is read; a bad one is a StateMismatchError naming it, never
# a panic (pyo3's PanicException is no Exception), a repeat or a loss.
# --------------------------------------------------------------------------


def sample_id(key: str) -> list[int]:
    """``[shard, index]`` of an uneven-dataset key ``uSS-IIII``."""
    shard, index = key[1:].split("-")
    return [int(shard), int(index)]


@pytest.fixture(scope="module")
def saved_slot(uneven_dataset):
    """A 1 x 1 state after 10 samples (the buffer holding several), the ids
    handed out, and the slot's units ``(shard, start, end)``."""
    ds = shardstream.StreamingDataset(uneven_dataset.spec, seed=SEED, shuffle_buffer=SHUFFLE)
    iterator = iter(ds)
    handed_out = [sample_id(next(iterator)["__key__"]) for _ in range(10)]
    state = json_round_trip(ds.state_dict())
    units = ds._stream.units
    del iterator
    assert len(state["buffer"]) >= 3 and state["cursor"]["next_sample"] is not None
    return state, handed_out, units


def damage_exact(case: str, good: dict, handed_out: list, units: list) -> dict:
    state = copy.deepcopy(good)
    cursor = state["cursor"]
    shard, _, end = units[cursor["unit"]]
    if case == "buffer-shard-past-the-dataset":
        state["buffer"][1] = [17, 0]
    elif case == "buffer-index-past-the-shard":
        state["buffer"][0] = [1, UNEVEN_COUNTS[1]]
    elif case == "buffer-not-yet-read":
        state["buffer"][0] = (
            [shard, cursor["next_sample"]]
            if cursor["next_sample"] < end
            else [
                units[cursor["unit"] + 1][0],
                units[cursor["unit"] + 1][1],
            ]
        )
    elif case == "buffer-held-twice":
        state["buffer"][-1] = state["buffer"][0]
    elif case == "buffer-longer-than-shuffle-buffer":
        state["buffer"] += handed_out[: SHUFFLE + 1 - len(state["buffer"])]
    elif case == "buffer-holds-a-sample-handed-out":
        state["buffer"][0] = handed_out[0]
    elif case == "buffer-sample-dropped":
        state["buffer"].pop()
    elif case == "cursor-past-the-units":
        cursor["unit"] = len(units) + 3
    elif case == "cursor-past-its-unit":
        cursor["next_sample"] = end + 5
    elif case == "produced-past-the-slot":
        state["produced"] = 10**6
    elif case == "rng-word-pos-absurd":
        state["rng_word_pos"] = str(2**100)
    elif case == "finished-with-a-buffer":
        state["finished"] = True
    elif case == "resumed-from-empty":
        state["resumed_from"] = []
    elif case == "digest-edited":
        state["digest"] = "0123456789abcdef"
    elif case == "rank-past-world-size":
        state["rank"] = 3
    elif case == "epoch-past-2-63":
        # set_epoch's bound (the epoch after it must fit too): before, the
        # state loaded and its next epochs repeated earlier ones (or
        # iterating raised OverflowError).
        state["epoch"] = 2**63 - 1
    else:
        raise AssertionError(case)
    return state


EXACT_DAMAGE = {
    "buffer-shard-past-the-dataset": r"buffer\[1\]: shard 17 is not below the dataset's 6 shards",
    "buffer-index-past-the-shard": r"buffer\[0\]: sample 40 of shard 1 is not below",
    "buffer-not-yet-read": r"buffer\[0\]: .* not among the samples the slot's cursor has passed",
    "buffer-held-twice": r"buffer\[\d+\]: .* held twice",
    "buffer-longer-than-shuffle-buffer": r"field buffer: holds 8 samples",
    "buffer-holds-a-sample-handed-out": r"field digest",
    "buffer-sample-dropped": r"field produced",
    "cursor-past-the-units": r"field cursor\.unit",
    "cursor-past-its-unit": r"field cursor\.next_sample",
    "produced-past-the-slot": r"field produced",
    "rng-word-pos-absurd": r"field rng_word_pos",
    "finished-with-a-buffer": r"field finished",
    "resumed-from-empty": r"field resumed_from",
    "digest-edited": r"field digest",
    "rank-past-world-size": r"field rank",
    "epoch-past-2-63": r"field epoch: 9223372036854775807 is not below 2\^63 - 1",
}


@pytest.mark.parametrize("case", list(EXACT_DAMAGE))
def test_damaged_exact_state_is_refused_naming_the_field(uneven_dataset, saved_slot, case):
    good, handed_out, units = saved_slot
    state = damage_exact(case, good, handed_out, units)
    ds = shardstream.StreamingDataset(uneven_dataset.spec, seed=SEED, shuffle_buffer=SHUFFLE)
    with pytest.raises(StateMismatchError, match=EXACT_DAMAGE[case]):
        ds.load_state_dict(state)
        collect(ds)  # the stream checks the state when it is made
    # The undamaged state still resumes.
    ds.load_state_dict(good)
    rest = keys_of(collect(ds))
    assert len(rest) + len(handed_out) == len(uneven_dataset.keys)


def damage_elastic(case: str, states: list[dict]) -> list[dict]:
    states = copy.deepcopy(states)
    holding = [i for i, s in enumerate(states) if s["buffer"] and not s["finished"]]
    first, last = holding[0], holding[-1]
    if case == "buffer-shard-past-the-dataset":
        states[first]["buffer"][0] = [17, 0]
    elif case == "two-different-states-of-one-slot":
        other = copy.deepcopy(states[first])
        other["produced"] += 1
        states.append(other)
    elif case == "one-sample-in-two-buffers":
        states[last]["buffer"][0] = states[first]["buffer"][0]
    elif case == "cursor-past-the-units":
        states[first]["cursor"] = {"unit": 10**6, "next_sample": None}
    elif case == "resumed-from-empty":
        for state in states:
            state["resumed_from"] = []
    elif case == "epochs-differ":
        states[last]["epoch"] += 1
    elif case == "missing-slot":
        del states[last]
    elif case == "mixed-fingerprints":
        states[last]["fingerprint"] = "0123456789abcdef"
    elif case == "world-size-absurd":
        for state in states:
            state["world_size"] = 2**60
    elif case == "epoch-past-2-63":
        for state in states:
            state["epoch"] = 2**64 - 1
    else:
        raise AssertionError(case)
    return states


ELASTIC_DAMAGE = {
    "buffer-shard-past-the-dataset": r"slots\[\d\]\.buffer\[0\]: shard 17 is not below",
    "two-different-states-of-one-slot": r"a second, different state of rank \d worker \d",
    "one-sample-in-two-buffers": r"slots\[\d\]\.buffer\[0\]",
    "cursor-past-the-units": r"slots\[\d\]\.cursor\.unit",
    "resumed-from-empty": r"slots\[0\]\.resumed_from: empty",
    "epochs-differ": r"slots\[\d\]\.epoch",
    "missing-slot": r"every one of the 4 x 2 slots",
    "mixed-fingerprints": r"slots\[\d\]\.fingerprint",
    "world-size-absurd": r"slots\[\d\]\.world_size: \d+ is above 1048576",
    "epoch-past-2-63": r"field epoch: 18446744073709551615 is not below 2\^63",
}
# The wrapper elastic_state makes: a version or field of another version
# (before, any version was read as this build's).
WRAPPER_DAMAGE = {
    "version": (99, r"field version: this build reads version 1 elastic states, got 99"),
    "version-missing": (None, r"field version: .* got None"),
    "unknown-field": ("extra", r"field extra: not a field of an elastic state"),
}


@pytest.mark.parametrize("case", list(WRAPPER_DAMAGE))
def test_an_elastic_state_of_another_version_is_refused(uneven_dataset, old_job, case):
    _, _, states = old_job("drop")
    elastic = shardstream.elastic_state(states)
    value, message = WRAPPER_DAMAGE[case]
    if case == "unknown-field":
        elastic["extra"] = 1
    elif value is None:
        del elastic["version"]
    else:
        elastic["version"] = value
    ds = slot_dataset(uneven_dataset, 0, 1, 1, 0, "drop")
    with pytest.raises(StateMismatchError, match=message):
        ds.load_state_dict(elastic)
    mix = shardstream.Mix([slot_dataset(uneven_dataset, 0, 1, 1, 0, "drop")], [1.0])
    with pytest.raises(StateMismatchError, match=message):
        mix.load_state_dict(elastic)


@pytest.mark.parametrize("case", list(ELASTIC_DAMAGE))
def test_damaged_elastic_state_is_refused_naming_the_field(uneven_dataset, old_job, case):
    _, _, states = old_job("drop")
    elastic = shardstream.elastic_state(damage_elastic(case, states))
    ds = slot_dataset(uneven_dataset, 0, 1, 1, 0, "drop")
    with pytest.raises(StateMismatchError, match=ELASTIC_DAMAGE[case]):
        ds.load_state_dict(elastic)
        collect(ds)


def uncounted(info: DatasetInfo, **options) -> shardstream.StreamingDataset:
    """A dataset over ``info`` without sample counts (no manifest: local tar
    shards' defaults), whole shards dealt by bytes."""
    return shardstream.StreamingDataset(
        info.spec, manifest=False, seed=SEED, shuffle_buffer=SHUFFLE, **options
    )


def head_and_state(dataset: shardstream.StreamingDataset, n: int) -> tuple[list[str], dict]:
    """The keys of the first ``n`` samples of ``dataset`` and its state then."""
    it = iter(dataset)
    head = [next(it)["__key__"] for _ in range(n)]
    return head, json_round_trip(dataset.state_dict())


UNCOUNTED_EDITS = {
    "a-held-sample-dropped": (lambda s: s["buffer"].pop(), "produced"),
    "one-fewer-handed-out": (lambda s: s.update(produced=s["produced"] - 1), "produced"),
    "digest-edited": (lambda s: s.update(digest="0123456789abcdef"), "digest"),
}


@pytest.mark.parametrize("edit", list(UNCOUNTED_EDITS))
def test_an_edited_state_of_an_uncounted_dataset_is_refused(uneven_dataset, edit):
    """Without sample counts, a state's counts and digest were not checked:
    an edited state loaded and its epoch came out short, without a word.
    The local shards are counted when the state is loaded."""
    change, field = UNCOUNTED_EDITS[edit]
    _, state = head_and_state(uncounted(uneven_dataset), 30)
    assert state["buffer"], "the edits need held samples"
    change(state)
    ds = uncounted(uneven_dataset)
    with pytest.raises(StateMismatchError, match=f"state field {field}: "):
        ds.load_state_dict(state)
        collect(ds)


def test_a_state_saved_uncounted_resumes_exactly_counted_or_not_and_elastically(uneven_dataset):
    """A state saved before the shards were counted resumes its epoch as
    planned then: into the same dataset (and the states of that resumed
    epoch again), into one that has counts now (the manifest beside the
    shards), and elastically onto two ranks. Before, the dataset with
    counts refused it as another shard list, and an elastic resume asked
    for a manifest, which then refused it too."""
    full = keys_of(uncounted(uneven_dataset))
    head, state = head_and_state(uncounted(uneven_dataset), 30)
    ds = uncounted(uneven_dataset)
    ds.load_state_dict(state)
    assert head + keys_of(ds) == full
    # Resumed, then saved again mid-epoch.
    ds = uncounted(uneven_dataset)
    ds.load_state_dict(state)
    middle, again = head_and_state(ds, 20)
    ds = uncounted(uneven_dataset)
    ds.load_state_dict(again)
    assert head + middle + keys_of(ds) == full
    counted = shardstream.StreamingDataset(uneven_dataset.spec, seed=SEED, shuffle_buffer=SHUFFLE)
    counted.load_state_dict(state)
    assert head + keys_of(counted) == full
    rests = []
    for rank in (0, 1):
        ds = uncounted(uneven_dataset, rank=rank, world_size=2)
        ds.load_state_dict(shardstream.elastic_state(state))
        rests.append(keys_of(ds))
    assert len(rests[0]) == len(rests[1]) == (len(full) - len(head)) // 2
    assert_exactly_once(head + rests[0] + rests[1], full)


def test_a_slot_state_given_twice_counts_once(uneven_dataset, old_job):
    old_full, consumed, states = old_job("drop")
    elastic = shardstream.elastic_state(states, states[3])
    ds = slot_dataset(uneven_dataset, 0, 1, 1, 0, "drop")
    ds.load_state_dict(elastic)
    check_elastic_accounting(
        old_full, consumed, [keys_of(collect(ds))], "drop", len(uneven_dataset.keys)
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_epochs_after_an_elastic_resume_onto_one_rank_are_a_fresh_dataset_s(
    tmp_path, num_workers
):
    """Local shards without a manifest, a job of 2 ranks (which counts
    them) resumed elastically onto 1 rank (which deals them whole). The
    resumed epoch is planned over counted shards; the epochs after it as a
    fresh dataset plans them, so a checkpoint taken in one resumes in a
    fresh dataset. Before, the counts stayed: the later epochs differed
    from a fresh dataset's (through workers), and their checkpoints were
    refused as "saved for another dataset"."""
    info = write_uneven_dataset(tmp_path / "d", (11, 30, 2, 0, 26))

    def make(epoch: int | None = None, **slot) -> shardstream.StreamingDataset:
        ds = shardstream.StreamingDataset(info.spec, seed=3, shuffle_buffer=5, **slot)
        if epoch is not None:
            ds.set_epoch(epoch)
        return ds

    states, consumed = [], []
    for rank in range(2):
        old = make(1, rank=rank, world_size=2)
        iterator = iter(old)
        consumed += keys_of([next(iterator) for _ in range(10)])
        states.append(old.state_dict())
    ds = make()
    assert not ds.shard_list.counted
    ds.load_state_dict(shardstream.elastic_state(*states))
    rest = keys_of(collect(loader(ds, num_workers)))
    # Exactly once, less what remainder="drop" leaves out of the old plan.
    counts = Counter(consumed + rest)
    assert max(counts.values()) == 1 and set(counts) <= set(info.keys)
    assert len(info.keys) - len(counts) < 2
    assert keys_of(collect(loader(ds, num_workers))) == keys_of(
        collect(loader(make(2), num_workers))
    )
    assert not ds.shard_list.counted
    # A checkpoint of epoch 3, resumed by a fresh dataset.
    iterator = iter(ds)
    taken = keys_of([next(iterator) for _ in range(7)])
    state = ds.state_dict()
    fresh = make()
    fresh.load_state_dict(state)
    assert taken + keys_of(collect(fresh)) == keys_of(collect(make(3)))


# --------------------------------------------------------------------------
# Elastic resume
# --------------------------------------------------------------------------

OLD_WORLD, OLD_WORKERS, OLD_EPOCH = 4, 2, 1
PARTIAL = [0, 3, "all", 1, 7, 2, "all-but-1", 5]
"""Samples each old slot hands out before the job stops ("all": to its end)."""


def slot_dataset(info, rank, world_size, num_workers, worker_id, remainder, **kwargs):
    return shardstream.StreamingDataset(
        info.spec,
        rank=rank,
        world_size=world_size,
        num_workers=num_workers,
        worker_id=worker_id,
        seed=SEED,
        shuffle_buffer=SHUFFLE,
        remainder=remainder,
        **kwargs,
    )


def run_old_job(info, remainder, **kwargs) -> tuple[list[str], list[str], list[dict]]:
    """A 4 x 2 job at epoch 1, every slot simulated with explicit rank and
    worker and stopped after its PARTIAL count. Returns every slot's full
    output (the uninterrupted job), what was consumed, and the slot states."""
    full, consumed, states = [], [], []
    for slot, partial in enumerate(PARTIAL):
        rank, worker = divmod(slot, OLD_WORKERS)
        args = (info, rank, OLD_WORLD, OLD_WORKERS, worker, remainder)
        ds = slot_dataset(*args, **kwargs)
        ds.set_epoch(OLD_EPOCH)
        slot_full = keys_of(collect(ds))
        ds = slot_dataset(*args, **kwargs)
        ds.set_epoch(OLD_EPOCH)
        iterator = iter(ds)
        if partial == "all":
            got = keys_of(iterator)
        else:
            n = len(slot_full) - 1 if partial == "all-but-1" else min(partial, len(slot_full))
            got = [next(iterator)["__key__"] for _ in range(n)]
        assert got == slot_full[: len(got)]
        state = json_round_trip(ds.state_dict())
        STATE_VALIDATOR.validate(state)
        assert state["produced"] == len(got)
        assert state["finished"] == (partial == "all")
        full += slot_full
        consumed += got
        states.append(state)
        del iterator
    return full, consumed, states


@pytest.fixture(scope="module")
def old_job(uneven_dataset):
    """``get(remainder)``: ``run_old_job`` on the uneven dataset, run once."""
    cache: dict = {}

    def get(remainder: str):
        if remainder not in cache:
            cache[remainder] = run_old_job(uneven_dataset, remainder)
        return copy.deepcopy(cache[remainder])

    return get


def run_new_job(
    info, elastic, world_size, num_workers, remainder, epoch=OLD_EPOCH
) -> list[list[str]]:
    """Each new rank loads the elastic state on a fresh dataset (epoch 0),
    then reads through a plain DataLoader (or in-process for 0 workers);
    ``epoch`` is the epoch the dataset is expected to take on."""
    per_rank = []
    for rank in range(world_size):
        ds = shardstream.StreamingDataset(
            info.spec,
            rank=rank,
            world_size=world_size,
            seed=SEED,
            shuffle_buffer=SHUFFLE,
            remainder=remainder,
        )
        ds.load_state_dict(elastic)
        assert ds.epoch == epoch  # the epoch comes from the state
        source = ds if num_workers == 0 else loader(ds, num_workers)
        per_rank.append(keys_of(collect(source)))
    return per_rank


def check_elastic_accounting(old_full, consumed, per_rank, remainder, n_total):
    world_size = len(per_rank)
    old_total = (
        math.ceil(n_total / OLD_WORLD) * OLD_WORLD
        if remainder == "pad"
        else n_total // OLD_WORLD * OLD_WORLD
    )
    assert len(old_full) == old_total
    remaining = Counter(old_full) - Counter(consumed)
    assert sum(remaining.values()) == old_total - len(consumed)
    n_remaining = old_total - len(consumed)
    new = Counter(k for keys in per_rank for k in keys)
    if remainder == "pad":
        per = math.ceil(n_remaining / world_size)
        assert [len(keys) for keys in per_rank] == [per] * world_size
        assert not remaining - new, "a not-yet-produced sample never came"
        assert (new - remaining).total() == per * world_size - n_remaining
    else:
        per = n_remaining // world_size
        assert [len(keys) for keys in per_rank] == [per] * world_size
        assert max(new.values(), default=1) == 1, "a sample came twice"
        assert not new - remaining, "an already-produced sample came again"


@pytest.mark.parametrize("remainder", ["pad", "drop"])
@pytest.mark.parametrize(
    ("world_size", "num_workers"),
    [(2, 3), (1, 0), (3, 2), (5, 1)],
    ids=["2x3-dataloader", "1x1-in-process", "3x2-dataloader", "5x1-dataloader"],
)
def test_elastic_resume_onto_another_layout(
    uneven_dataset, old_job, remainder, world_size, num_workers
):
    old_full, consumed, states = old_job(remainder)
    elastic = json_round_trip(shardstream.elastic_state(states))
    STATE_VALIDATOR.validate(elastic)
    assert elastic["format"] == "shardstream.elastic" and len(elastic["slots"]) == 8
    per_rank = run_new_job(uneven_dataset, elastic, world_size, num_workers, remainder)
    check_elastic_accounting(old_full, consumed, per_rank, remainder, len(uneven_dataset.keys))


@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_elastic_resume_onto_the_same_layout(uneven_dataset, old_job, remainder):
    """The new layout may be the old one. Its ranks had consumed different
    amounts, yet the new ranks must get equal counts (else DDP hangs), with
    the same accounting as for any other layout."""
    old_full, consumed, states = old_job(remainder)
    elastic = shardstream.elastic_state(states)
    per_rank = []
    for rank in range(OLD_WORLD):
        keys = []
        for worker in range(OLD_WORKERS):
            ds = slot_dataset(uneven_dataset, rank, OLD_WORLD, OLD_WORKERS, worker, remainder)
            ds.load_state_dict(elastic)
            keys += keys_of(collect(ds))
        per_rank.append(keys)
    check_elastic_accounting(old_full, consumed, per_rank, remainder, len(uneven_dataset.keys))


def test_elastic_resume_from_stateful_dataloaders(uneven_dataset):
    """The realistic path: every rank of a 2 x 2 job saves its
    ``StatefulDataLoader.state_dict()``; a 3-rank job with 2 plain DataLoader
    workers per rank takes over."""
    kwargs = {"world_size": 2, "epoch": OLD_EPOCH}
    full, consumed, saved = [], [], []
    for rank, k in [(0, 2), (1, 5)]:
        full += [
            key for b in make_loader(uneven_dataset, 2, True, rank=rank, **kwargs) for key in b
        ]
        prefix, state = save_after(uneven_dataset, 2, True, k, rank=rank, **kwargs)
        consumed += [key for batch in prefix for key in batch]
        saved.append(state)
    elastic = shardstream.elastic_state(*saved)
    STATE_VALIDATOR.validate(elastic)
    assert sorted((s["rank"], s["worker_id"]) for s in elastic["slots"]) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    per_rank = run_new_job(uneven_dataset, elastic, 3, 2, "drop")
    new = [k for keys in per_rank for k in keys]
    remaining = set(full) - set(consumed)
    assert len(new) == len(remaining) // 3 * 3
    assert_exactly_once(new, set(new))
    assert set(new) <= remaining


def test_elastic_resume_twice(uneven_dataset, old_job):
    """4 x 2 stops; 3 x 1 takes over and stops too; 1 x 1 finishes: with
    "drop", every sample still comes at most once."""
    _, consumed, states = old_job("drop")
    elastic = shardstream.elastic_state(states)
    middle, mid_states = [], []
    for rank in range(3):
        ds = slot_dataset(uneven_dataset, rank, 3, 1, 0, "drop")
        ds.load_state_dict(elastic)
        iterator = iter(ds)
        middle += [next(iterator)["__key__"] for _ in range(2 * rank + 1)]
        state = json_round_trip(ds.state_dict())
        STATE_VALIDATOR.validate(state)
        assert len(state["resumed_from"]) == 8
        mid_states.append(state)
        del iterator
    (last,) = run_new_job(uneven_dataset, shardstream.elastic_state(mid_states), 1, 0, "drop")
    every = consumed + middle + last
    assert_exactly_once(every, set(every))
    remaining_after_old = len(uneven_dataset.keys) // OLD_WORLD * OLD_WORLD - len(consumed)
    assert len(middle) + len(last) == remaining_after_old // 3 * 3


def test_exact_resume_after_an_elastic_resume(uneven_dataset, old_job):
    _, _, states = old_job("pad")
    elastic = shardstream.elastic_state(states)

    def fresh():
        ds = slot_dataset(uneven_dataset, 1, 2, 1, 0, "pad")
        ds.load_state_dict(elastic)
        return ds

    full = keys_of(collect(fresh()))
    ds = fresh()
    iterator = iter(ds)
    prefix = [next(iterator)["__key__"] for _ in range(4)]
    state = json_round_trip(ds.state_dict())
    del iterator
    resumed = slot_dataset(uneven_dataset, 1, 2, 1, 0, "pad")
    resumed.load_state_dict(state)
    assert prefix + keys_of(collect(resumed)) == full


def test_elastic_resume_of_a_finished_epoch(uneven_dataset):
    states = []
    for rank in range(2):
        ds = slot_dataset(uneven_dataset, rank, 2, 1, 0, "pad")
        ds.set_epoch(OLD_EPOCH)
        collect(iter(ds))
        states.append(ds.state_dict())
    assert all(s["finished"] for s in states)
    # Nothing is left; the iteration after it is the next epoch.
    elastic = shardstream.elastic_state(states)
    per_rank = run_new_job(uneven_dataset, elastic, 3, 0, "pad", epoch=OLD_EPOCH + 1)
    assert per_rank == [[], [], []]


def test_elastic_resume_needs_every_slot(uneven_dataset, old_job):
    _, _, states = old_job("drop")
    ds = slot_dataset(uneven_dataset, 0, 1, 1, 0, "drop")
    ds.load_state_dict(shardstream.elastic_state(states[:-1]))
    with pytest.raises(StateMismatchError, match="every one of the 4 x 2 slots"):
        collect(ds)


def test_elastic_resume_needs_sample_counts(uneven_dataset):
    no_counts = {"manifest": False, "count_samples": False}
    states = []
    for worker in range(2):
        ds = slot_dataset(uneven_dataset, 0, 1, 2, worker, "drop", **no_counts)
        iterator = iter(ds)
        next(iterator)
        states.append(ds.state_dict())
        del iterator
    ds = slot_dataset(uneven_dataset, 0, 1, 1, 0, "drop", **no_counts)
    ds.load_state_dict(shardstream.elastic_state(states))
    with pytest.raises(StateMismatchError, match="manifest"):
        collect(ds)


def test_elastic_state_gathers_from_any_nesting(uneven_dataset, old_job):
    _, _, states = old_job("drop")
    flat = shardstream.elastic_state(*states)
    nested = shardstream.elastic_state(
        {"rank0": {"loader": states[:2]}}, [states[2:5], (states[5],)], {"x": states[6:]}
    )
    assert nested == flat == shardstream.elastic_state(states)
    with pytest.raises(ValueError):
        shardstream.elastic_state({"model": {}}, [])


# --------------------------------------------------------------------------
# A real crash: examples/resume.py killed with SIGKILL, then restarted
# --------------------------------------------------------------------------


def run_example(args: list[str], cwd) -> subprocess.CompletedProcess[str]:
    """Runs ``examples/resume.py`` in its own process group; the group
    (DataLoader workers included) is killed afterwards or on timeout."""
    command = [sys.executable, str(EXAMPLES_DIR / "resume.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return run_bounded(command, cwd=cwd, env=env, timeout=SUBPROCESS_TIMEOUT)


def test_killed_and_resumed_run_is_one_epoch(uneven_dataset, tmp_path):
    """Three processes: one whole epoch; one killed by SIGKILL right after
    its checkpoint at step 7; one resuming from that checkpoint."""
    num_workers = 2
    common = [uneven_dataset.spec, "--batch-size", "4", "--num-workers", str(num_workers)]
    common += ["--seed", "17", "--epoch", "3"]

    whole = run_example([*common, "--keys-out", tmp_path / "whole.json"], tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected = json.loads((tmp_path / "whole.json").read_text())
    assert_exactly_once(expected, uneven_dataset.keys)

    state_path = tmp_path / "ckpt" / "state.json"
    kill_at_7 = ["--save-at", "7", "--state", state_path, "--kill"]
    killed = run_example([*common, *kill_at_7, "--keys-out", tmp_path / "before.json"], tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "done" not in killed.stdout
    checkpoint = json.loads(state_path.read_text())
    before = json.loads((tmp_path / "before.json").read_text())
    assert checkpoint["keys"] == before
    assert len(before) == 7 * 4
    assert len(validate_states(checkpoint["state"])) == max(num_workers, 1)
    assert [p.name for p in state_path.parent.iterdir()] == ["state.json"]  # no temp left

    resumed = run_example(
        [*common, "--resume", state_path, "--keys-out", tmp_path / "after.json"], tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = json.loads((tmp_path / "after.json").read_text())
    assert before + after == expected
    # The resumed model saw the same batches: it ends where the whole run did.
    assert whole.stdout.strip().split()[-1] == resumed.stdout.strip().split()[-1]


# --------------------------------------------------------------------------
# Seams where a framework's calls used to lose the stream's state
# --------------------------------------------------------------------------


@pytest.mark.parametrize("state_first", [True, False], ids=["state-first", "set-epoch-only"])
def test_set_epoch_of_the_epoch_in_progress_keeps_its_state(
    uneven_dataset, uninterrupted, state_first
):
    """``StatefulDataLoader`` (and Accelerate) may take a state before the
    first batch and call ``set_epoch`` once the epoch's iterator exists: the
    checkpoint after 3 batches is still the state of the stream read."""
    full = uninterrupted(0, True)
    dl = make_loader(uneven_dataset, 0, True)
    if state_first:
        dl.state_dict()
    iterator = iter(dl)
    dl.dataset.set_epoch(EPOCH)
    prefix = [next(iterator) for _ in range(3)]
    state = json_round_trip(dl.state_dict())
    assert sum(s["produced"] for s in slot_states(state)) == 3 * BATCH
    assert prefix + resume_rest(uneven_dataset, 0, True, state) == full
    # The epoch in progress did not become the next one again.
    assert dl.dataset.epoch == EPOCH + 1


def test_set_epoch_of_an_ended_epoch_replays_it(uneven_dataset, uninterrupted):
    """Once the epoch's iteration has ended, ``set_epoch`` of it is a
    request to stream it again."""
    dl = make_loader(uneven_dataset, 0, True)
    first = collect(dl)
    dl.dataset.set_epoch(EPOCH)
    assert collect(dl) == first == uninterrupted(0, True)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_finished_state_without_a_shuffle_buffer_loads(
    uneven_dataset, uninterrupted, num_workers
):
    """With ``shuffle_buffer=0`` the last units end after the last sample:
    the state saved at the epoch's end still says where the cursor is."""
    full = uninterrupted(num_workers, True, shuffle_buffer=0)
    prefix, state = save_after(
        uneven_dataset, num_workers, True, len(full), at_end=True, shuffle_buffer=0
    )
    assert prefix == full
    slots = validate_states(state)
    assert all(s["finished"] for s in slots)
    assert resume_rest(uneven_dataset, num_workers, True, state, shuffle_buffer=0) == (
        uninterrupted(num_workers, True, shuffle_buffer=0, epoch=EPOCH + 1)
    )
    for slot in slots:
        ds = shardstream.StreamingDataset(uneven_dataset.spec, seed=SEED, shuffle_buffer=0)
        ds.load_state_dict(slot)
        assert ds.epoch == EPOCH + 1


@pytest.mark.parametrize("num_workers", [2, 3])
def test_elastic_resume_into_a_plain_dataloader_then_two_more_epochs(
    uneven_dataset, old_job, num_workers
):
    """An elastic state loaded into the dataset, then a plain DataLoader
    whose workers are forked anew each epoch: the first pass is the rest
    of the saved epoch, the next ones the epochs after it, whole."""
    old_full, consumed, states = old_job("drop")
    ds = slot_dataset(uneven_dataset, 0, 1, None, None, "drop")
    ds.load_state_dict(shardstream.elastic_state(states))
    dl = loader(ds, num_workers)
    rest = keys_of(collect(dl))
    assert_exactly_once(consumed + rest, old_full)
    for epoch in (OLD_EPOCH + 1, OLD_EPOCH + 2):
        fresh = slot_dataset(uneven_dataset, 0, 1, None, None, "drop")
        fresh.set_epoch(epoch)
        assert keys_of(collect(dl)) == keys_of(collect(loader(fresh, num_workers))), epoch
    assert ds.epoch == OLD_EPOCH + 3


def test_len_of_a_loader_whose_workers_yield_other_batches_is_refused(uneven_dataset):
    """86 samples in 3 workers (29, 29, 28) at batch_size 4 give 8 + 8 + 7
    batches where ``len(loader)`` would say 22: a framework ending the epoch
    after 22 would leave a batch out, so ``len()`` says so instead."""
    ds = shardstream.StreamingDataset(uneven_dataset.spec, seed=SEED)
    assert len(ds) == 86
    from torch.utils.data import DataLoader

    bad = DataLoader(ds, batch_size=4, num_workers=3, collate_fn=key_batch)
    with pytest.raises(TypeError, match=r"len\(loader\) would be 22, but its 3 workers yield 23"):
        len(bad)
    stateful = StatefulDataLoader(ds, batch_size=4, num_workers=3, collate_fn=key_batch)
    with pytest.raises(TypeError, match="divides every worker's share"):
        len(stateful)
    dropping = DataLoader(ds, batch_size=2, num_workers=2, collate_fn=key_batch, drop_last=True)
    with pytest.raises(TypeError, match=r"42 batches.*1 fewer than len"):
        len(dropping)
    # A batch size that divides every share, or one worker, agrees.
    for good in (
        DataLoader(ds, batch_size=4, num_workers=1, collate_fn=key_batch),
        DataLoader(ds, batch_size=43, num_workers=2, collate_fn=key_batch, drop_last=True),
    ):
        assert len(good) == len(collect(good))

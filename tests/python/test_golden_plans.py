"""Pinned plans: shard orders, cuts and shuffle orders for a few fixed inputs.

Resumes across versions, and jobs whose ranks run different builds, depend
on the scheduler giving the same output for the same inputs. A change to
any of these is a deliberate one: regenerate the fixture with
``SHARDSTREAM_BLESS=1 pytest tests/python/test_golden_plans.py`` and say
why in CHANGELOG.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import shardstream
from shardstream import _core

FIXTURE = Path(__file__).with_name("fixtures") / "golden_plans.json"

SIZES = [1000, 2500, None, 400, 9000, 10, 7000, 7000, 300, 1200]
COUNTS = [5, 0, 13, 7, 1, 22, 3, 9]


def compute(dataset) -> dict[str, Any]:
    plans: dict[str, Any] = {}
    for seed, epoch, world, workers, shuffle in [
        (0, 0, 1, 1, True),
        (7, 3, 2, 2, True),
        (7, 4, 2, 2, True),
        (123, 0, 3, 1, False),
    ]:
        name = f"by_bytes seed={seed} epoch={epoch} world={world} workers={workers}"
        plans[name] = _core.plan_epoch(
            SIZES,
            seed=seed,
            epoch=epoch,
            world_size=world,
            num_workers=workers,
            shuffle_shards=shuffle,
        )
    for seed, epoch, world, workers, remainder in [
        (11, 0, 3, 2, "drop"),
        (11, 0, 3, 2, "pad"),
        (11, 1, 4, 1, "drop"),
    ]:
        name = f"by_samples seed={seed} epoch={epoch} world={world} workers={workers} {remainder}"
        plans[name] = [
            [list(unit) for unit in slot]
            for slot in _core.plan_samples(
                COUNTS,
                seed=seed,
                epoch=epoch,
                world_size=world,
                num_workers=workers,
                remainder=remainder,
            )
        ]
    # Shard order and shuffle buffer together, as one slot streams them.
    for seed, epoch, buffer in [(3, 0, 10), (3, 1, 10), (99, 5, 1000)]:
        ds = shardstream.StreamingDataset(
            dataset.spec, seed=seed, shuffle_buffer=buffer, shuffle_initial=min(buffer, 4)
        )
        ds.set_epoch(epoch)
        plans[f"stream seed={seed} epoch={epoch} shuffle_buffer={buffer}"] = [
            s["__key__"] for s in ds
        ]
    return plans


def test_plans_match_the_pinned_fixture(dataset):
    got = compute(dataset)
    if os.environ.get("SHARDSTREAM_BLESS") == "1":
        FIXTURE.write_text(json.dumps(got, indent=1) + "\n")
    pinned = json.loads(FIXTURE.read_text())
    assert sorted(got) == sorted(pinned)
    for name, plan in pinned.items():
        assert got[name] == plan, f"the plan {name!r} changed"

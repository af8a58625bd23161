"""Pinned mixture plans: per-slot counts and orders for a few fixed inputs.

Exact resumes across versions, and jobs whose ranks run different builds,
depend on the mixture order being the same for the same inputs. A change is
a deliberate one: regenerate the fixture with
``SHARDSTREAM_BLESS=1 pytest tests/python/test_golden_mix.py`` and say why in
CHANGELOG.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from shardstream import _core

FIXTURE = Path(__file__).with_name("fixtures") / "golden_mix.json"


def compute() -> dict[str, Any]:
    plans: dict[str, Any] = {}
    for policy, weights, available, seed, epoch, slot, generation in [
        ("stop", [0.7, 0.3], [40, 30], 0, 0, 0, 0),
        ("stop", [0.5, 0.25, 0.25], [20, 20, 20], 5, 3, 7, 1),
        ("restart", [0.2, 0.8], [10, 20], 9, 1, 2, 0),
        ("continue", [0.6, 0.4], [25, 25], 1, 2, 3, 2),
        ("continue", [1.0, 0.0, 2.0], [10, 10, 10], 2**63, 2**32 - 1, 0, 0),
    ]:
        counts = _core.mix_counts(policy, weights, available)
        order = _core.mix_order(
            policy, weights, counts, seed=seed, epoch=epoch, slot=slot, generation=generation
        )
        name = (
            f"{policy} weights={weights} available={available} seed={seed} epoch={epoch} "
            f"slot={slot} generation={generation}"
        )
        plans[name] = {"counts": counts, "order": list(order)}
    return plans


def test_mixture_plans_match_the_pinned_fixture():
    got = compute()
    if os.environ.get("SHARDSTREAM_BLESS") == "1":
        FIXTURE.write_text(json.dumps(got, indent=1) + "\n")
    pinned = json.loads(FIXTURE.read_text())
    assert sorted(got) == sorted(pinned)
    for name, plan in pinned.items():
        assert got[name] == plan, f"the mixture plan {name!r} changed"

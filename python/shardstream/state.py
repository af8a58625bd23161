"""Gathering slot states for elastic resume."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["elastic_state"]


def _slot_states(obj: Any, found: list[dict[str, Any]]) -> None:
    if isinstance(obj, Mapping):
        if obj.get("format") in ("shardstream.state", "shardstream.mix"):
            found.append(dict(obj))
            return
        for value in obj.values():
            _slot_states(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _slot_states(value, found)


def elastic_state(*states: Any) -> dict[str, Any]:
    """Gathers the slot states of a whole job for an elastic resume.

    Pass what every rank saved: ``StatefulDataLoader.state_dict()`` results,
    ``StreamingDataset.state_dict()`` or ``Mix.state_dict()`` results, or
    lists of them. Every ``(rank, worker)`` slot of the saved layout must be
    present (the identical states of the ranks of one model-parallel group
    count once). Load the result with ``load_state_dict`` of the same kind of
    dataset in the new job (any world size and ``num_workers``), before
    creating its DataLoader.
    """
    found: list[dict[str, Any]] = []
    for state in states:
        _slot_states(state, found)
    if not found:
        raise ValueError("no shardstream slot state found in the given states")
    return {"format": "shardstream.elastic", "version": 1, "slots": found}

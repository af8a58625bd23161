"""Gathering slot states for elastic resume."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._core import StateMismatchError

__all__ = ["elastic_state"]

ELASTIC_FORMAT = "shardstream.elastic"
"""The ``format`` of what ``elastic_state`` returns."""
ELASTIC_VERSION = 1
"""Its ``version``: the one this build reads and writes."""


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
    return {"format": ELASTIC_FORMAT, "version": ELASTIC_VERSION, "slots": found}


def elastic_slots(state: Mapping[str, Any]) -> Any:
    """The ``slots`` of ``state`` when it is what ``elastic_state`` returns
    (their form is checked by the dataset that loads them), ``None`` when it
    is not. An elastic state of another version, with fields of another
    version, or whose ``slots`` is not a non-empty list, is a
    ``StateMismatchError``."""
    if state.get("format") != ELASTIC_FORMAT:
        return None
    version = state.get("version")
    if type(version) is not int or version != ELASTIC_VERSION:
        raise StateMismatchError(
            f"state field version: this build reads version {ELASTIC_VERSION} elastic states, "
            f"got {version!r} (saved by another shardstream version?)"
        )
    unknown = sorted(map(str, set(state) - {"format", "version", "slots"}))
    if unknown:
        raise StateMismatchError(f"state field {unknown[0]}: not a field of an elastic state")
    slots = state.get("slots")
    if not isinstance(slots, list) or not slots:
        raise StateMismatchError(
            f"state field slots: expected a list of every slot's state, got {slots!r:.80}"
        )
    return slots

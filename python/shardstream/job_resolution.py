"""One resolution per job: under ``torch.distributed``, rank 0 resolves a
dataset (listings, HEADs, Parquet footers, the manifest, sample counts) and
every other rank receives the resolved shard list (its compact pickled form)
through the process group's store, instead of listing the bucket itself.

Nothing here is a collective: rank 0 never waits, and a rank that finds no
resolution from rank 0 (rank 0 made no such dataset, or made it much later)
resolves by itself after a bounded wait, with a warning, so that a dataset
made on some ranks only can never hang a job. A resolution error on rank 0
reaches every rank as the same exception.
"""

from __future__ import annotations

import hashlib
import pickle
import re
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ._core import ShardList, ShardStreamError

__all__ = ["resolve_once"]

# How long a rank waits for rank 0 to say it started resolving the same
# dataset, and then for its result: the listing of a million keys takes
# minutes, a rank 0 that made no such dataset never starts.
START_WAIT = timedelta(seconds=60)
RESULT_WAIT = timedelta(minutes=30)
# The store is polled in slices of this, so that a lost rank 0 shows.
POLL = timedelta(seconds=5)

_made: Counter[str] = Counter()


def _default_store() -> Any | None:
    """The default process group's key-value store, if it can be had."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _key(specs: Sequence[str], options: Any) -> str:
    """The store key of this process's n-th dataset of these specs and
    options: ranks that make the same datasets in the same order agree."""
    # Without the addresses a repr may show (a transform's), which differ
    # between processes.
    shown = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(options))
    digest = hashlib.sha256(repr((list(specs), shown)).encode()).hexdigest()[:32]
    _made[digest] += 1
    return f"shardstream/resolution/{digest}/{_made[digest]}"


def _wait(store: Any, key: str, limit: timedelta) -> bool:
    """Whether ``key`` appeared in ``store`` within ``limit``."""
    deadline = time.monotonic() + limit.total_seconds()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            store.wait([key], timedelta(seconds=min(left, POLL.total_seconds())))
            return True
        except RuntimeError as e:  # a timeout (DistStoreError is one)
            if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                raise


def resolve_once(specs: Sequence[str], options: Any, resolve: Callable[[], ShardList]) -> ShardList:
    """``resolve()`` on rank 0 of an initialised process group, its result
    (or its error) handed to the other ranks; ``resolve()`` everywhere when
    there is no process group of several ranks."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return resolve()
    store = _default_store()
    if store is None:
        return resolve()
    key = _key(specs, options)
    if dist.get_rank() == 0:
        store.set(f"{key}/started", b"1")
        try:
            shard_list = resolve()
        except (ShardStreamError, ValueError, TypeError, OSError) as error:
            store.set(key, _pickled_error(error))
            raise
        store.set(key, pickle.dumps(("ok", shard_list)))
        return shard_list
    if not (_wait(store, f"{key}/started", START_WAIT) and _wait(store, key, RESULT_WAIT)):
        warnings.warn(
            "shardstream: rank 0 did not resolve this dataset (is it made on every rank, "
            "in the same order?); this rank resolves it by itself",
            RuntimeWarning,
            stacklevel=3,
        )
        return resolve()
    kind, value = pickle.loads(store.get(key))
    if kind == "error":
        raise value
    received: ShardList = value
    return received


def _pickled_error(error: BaseException) -> bytes:
    """``error`` for the other ranks: itself, or a ``ShardStreamError`` with
    its message when it does not pickle."""
    try:
        return pickle.dumps(("error", error))
    except (pickle.PicklingError, TypeError, AttributeError):
        return pickle.dumps(("error", ShardStreamError(str(error))))

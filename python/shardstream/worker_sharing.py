"""What DataLoader workers share with the process that made the dataset,
whatever their start method: the ``EpochTable`` (the epoch of each worker's
next iteration), the stream ``Counters`` (``stats()``) and a mixture's
``SharedWeights`` (``Mix.set_weights``).

All live in shared memory, which forked workers inherit. For workers
started with ``spawn`` or ``forkserver``, ``multiprocessing`` pickles them
(with its ``ForkingPickler``) as their memory's file descriptor, so that the
worker attaches to the same memory: it advances the same epochs and adds to
the same counters as the main process reads. Plain ``pickle`` gives an
unshared copy of the epochs and fresh counters instead.

Importing this module registers how; ``shardstream.epochs``, which every
dataset and mixture imports, imports it.

A dataset pickled to start such a worker also checks that the worker can
start (``check_worker_start``): the ``__main__`` guard of the script, and
a ``collate_fn`` that can be pickled.
"""

from __future__ import annotations

import ast
import sys
import warnings
from multiprocessing.context import get_spawning_popen
from multiprocessing.reduction import DupFd, ForkingPickler
from pathlib import Path
from types import FrameType
from typing import Any

from ._core import Counters, EpochTable, ShardStreamError, SharedWeights

__all__ = ["WorkerStartError"]


def _no_shared_memory(what: str, consequence: str) -> None:
    warnings.warn(
        f"no shareable memory for the {what} on this system: DataLoader workers started "
        f"with spawn or forkserver {consequence}",
        RuntimeWarning,
        stacklevel=3,
    )


def _share_epoch_table(table: EpochTable) -> tuple[Any, tuple[Any, ...]]:
    """An epoch table for a process ``multiprocessing`` starts: its memory's
    descriptor, so that the worker advances the same epochs as the main
    process (an unshared copy where the table has no descriptor)."""
    fd = table.fd()
    if fd is None:
        _no_shared_memory(
            "epoch table", "keep epochs of their own; call set_epoch before each epoch"
        )
        return (EpochTable._from_values, (table.values(),))
    return (_attach_epoch_table, (DupFd(fd),))


def _attach_epoch_table(shared: Any) -> EpochTable:
    """Unpickles a shared epoch table in the process it was handed to."""
    return EpochTable._attach(shared.detach())


def _share_counters(counters: Counters) -> tuple[Any, tuple[Any, ...]]:
    """Stream counters for a process ``multiprocessing`` starts: their
    memory's descriptor, so that the worker's streams count in the main
    process's ``stats()`` (fresh counters where they have no descriptor)."""
    fd = counters.fd()
    if fd is None:
        _no_shared_memory(
            "stream counters", "count in their own copy, which stats() in this process does not see"
        )
        return (Counters, ())
    return (_attach_counters, (DupFd(fd),))


def _attach_counters(shared: Any) -> Counters:
    """Unpickles shared counters in the process they were handed to."""
    return Counters._attach(shared.detach())


def _share_weights(weights: SharedWeights) -> tuple[Any, tuple[Any, ...]]:
    """A mixture's weights for a process ``multiprocessing`` starts: their
    memory's descriptor, so that ``Mix.set_weights`` reaches the worker
    (an unshared copy where the table has no descriptor)."""
    fd = weights.fd()
    if fd is None:
        _no_shared_memory(
            "mixture weights", "keep the weights they started with; set_weights does not reach them"
        )
        return (SharedWeights._from_parts, weights._held())
    return (_attach_weights, (DupFd(fd),))


def _attach_weights(shared: Any) -> SharedWeights:
    """Unpickles shared mixture weights in the process they were handed to."""
    return SharedWeights._attach(shared.detach())


ForkingPickler.register(EpochTable, _share_epoch_table)
ForkingPickler.register(SharedWeights, _share_weights)
ForkingPickler.register(Counters, _share_counters)


class WorkerStartError(ShardStreamError, RuntimeError):
    """DataLoader workers started with ``spawn`` or ``forkserver`` could not
    start as the script is written: raised in the main process, before any
    worker starts, naming what to change."""


def check_worker_start() -> None:
    """Called while a dataset is pickled. Where it is pickled to start a
    ``spawn`` or ``forkserver`` process (a DataLoader starting its workers),
    raises ``WorkerStartError`` for what would make those workers fail or
    hang: a script whose code runs outside ``if __name__ == "__main__":``
    (each worker imports the script again and would run it), or a loader
    whose ``collate_fn`` or ``worker_init_fn`` cannot be pickled."""
    popen = get_spawning_popen()
    if popen is None:
        return
    method = getattr(popen, "method", "spawn")
    frames = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    _check_loader_functions(frames, method)
    _check_main_guard(frames, method)


def _check_loader_functions(frames: list[FrameType], method: str) -> None:
    """The functions of the DataLoader starting the workers (a local named
    ``loader`` of a frame above, as torch's worker iterator takes it) are
    pickled for them: one that cannot be is named here."""
    data = sys.modules.get("torch.utils.data")
    if data is None:
        return
    loaders = (frame.f_locals.get("loader") for frame in frames)
    loader = next((each for each in loaders if isinstance(each, data.DataLoader)), None)
    for name in ("collate_fn", "worker_init_fn"):
        function = getattr(loader, name, None)
        if function is None:
            continue
        try:
            ForkingPickler.dumps(function)
        except Exception as error:
            raise WorkerStartError(
                f"the DataLoader's {name} {function!r} cannot be pickled, and workers started "
                f"with {method} need it: define it at module level of an importable module "
                f"instead of as a lambda or a nested function ({type(error).__name__}: {error})"
            ) from error


def _check_main_guard(frames: list[FrameType], method: str) -> None:
    """Where the workers start from the top-level code of the script being
    run, that code must sit under ``if __name__ == "__main__":``."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path:
        return  # an interactive session or `python -c`: nothing is imported again
    top = next(
        (f for f in frames if f.f_code.co_name == "<module>" and f.f_globals is vars(main)),
        None,
    )
    if top is None:
        return
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return
    line = top.f_lineno
    if any(
        _is_main_guard(node) and node.lineno <= line <= (node.end_lineno or node.lineno)
        for node in tree.body
    ):
        return
    raise WorkerStartError(
        f"DataLoader workers started with {method} import {path} again, and its line {line}, "
        'which starts them, runs outside `if __name__ == "__main__":`: each worker would run '
        "the script's top-level code again (start workers of its own, or wait at a collective "
        "forever). Put the code that makes the loader and trains under that guard, or in a "
        "function called from it"
    )


def _is_main_guard(node: ast.stmt) -> bool:
    """Whether ``node`` is ``if __name__ == "__main__":`` (either order)."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    sides = [node.test.left, *node.test.comparators]
    names = any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
    mains = any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)
    return names and mains

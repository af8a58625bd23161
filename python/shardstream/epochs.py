"""Which epoch the next iteration streams: one mechanism for
``StreamingDataset`` and ``Mix``.

The epoch of each process's next iteration lives in an ``EpochTable`` that
forked and spawned DataLoader workers share with the process that made the
dataset (``shardstream.worker_sharing``): an iteration in a worker advances
that worker's entry, one in the main process (or ``set_epoch`` there) every
entry. A loaded state is held here as the pending resume of its epoch until
an iteration uses it; each entry also says whether its process has yet to
use it (``PENDING``), so a worker that a plain DataLoader forks for a later
epoch, from a main process that still holds the loaded state, streams that
epoch instead of the resumed rest again.
"""

from __future__ import annotations

import operator
import os
from typing import Generic, TypeVar

from torch.utils.data import get_worker_info

# Imported for what it registers: how spawned workers attach to the table
# (and to the stream counters).
from . import worker_sharing  # noqa: F401
from ._core import EpochTable, StateMismatchError

Resume = TypeVar("Resume")

PENDING = 1 << 63
"""The bit of a table entry that says its process has a loaded state to
resume at its next iteration (epochs stay below it)."""


class EpochAdvance(Generic[Resume]):
    """The epoch of this process's next iteration and the resume pending for
    it. ``limit``: epochs must be below it (``None``: no bound)."""

    def __init__(self, limit: int | None = None) -> None:
        self._table = EpochTable()
        self._limit = limit
        # (worker_id, num_workers) of a DataLoader2 worker, set by
        # ``shardstream.datapipes``; DataLoader workers are found by torch.
        self.pipe_worker: tuple[int, int] | None = None
        self.resume: Resume | None = None
        self._resume_epoch: int | None = None
        # The process id of the last process that began an iteration.
        self._began_in: int | None = None

    def worker_entry(self) -> tuple[int, int] | None:
        """``(worker_id, num_workers)`` of this process when it is a
        DataLoader or DataLoader2 worker: its entry of the table. ``None``
        elsewhere."""
        info = get_worker_info()
        return (info.id, info.num_workers) if info is not None else self.pipe_worker

    @property
    def next(self) -> int:
        """The epoch of this process's next iteration."""
        return self._entry() & ~PENDING

    @property
    def furthest(self) -> int:
        """The furthest epoch any process sharing the table iterates next
        (a DataLoader's main process reads worker 0's entry as its own;
        another worker may have started the epoch first)."""
        return max(value & ~PENDING for value in self._table.values())

    def pending(self) -> Resume | None:
        """The loaded state this process's next iteration resumes, if it
        has not been used yet in this process (nor, for a DataLoader worker,
        by the worker of the same id that an earlier iteration of the same
        DataLoader started).

        Raises ``StateMismatchError`` in a worker (of a DataLoader or
        DataLoader2) whose entry says a state is pending that the worker
        does not hold: the state was loaded in
        the main process after the worker was made (a persistent worker
        of a DataLoader that has run), which would otherwise stream the
        state's epoch from its start."""
        if not self._entry() & PENDING:
            return None
        # The main process shares worker 0's entry, which a worker that
        # loads its own state (StatefulDataLoader's) marks pending.
        if self.resume is None and self.worker_entry() is not None:
            raise StateMismatchError(
                "a state was loaded (load_state_dict) after this DataLoader's workers were "
                "made, and they hold the dataset as it was before: load the state before "
                "making the DataLoader, or make a new DataLoader once it is loaded"
            )
        return self.resume

    def _entry(self) -> int:
        """This process's entry of the table, ``PENDING`` bit included."""
        entry = self.worker_entry()
        return int(self._table.get(entry[0] if entry is not None else 0))

    def set(self, epoch: int, running: int | None = None) -> bool:
        """``set_epoch``: makes ``epoch`` the next iteration's, dropping a
        pending resume of another epoch. True if the epoch changed (an
        iterator kept for the old one is then stale).

        ``running``: the epoch of this process's iteration in progress (not
        yet at its end), if any. Setting that epoch again changes nothing:
        frameworks call ``set_epoch`` once the epoch's iterator exists
        (Lightning's epoch hooks, ``StatefulDataLoader``), and the state of
        the stream being read must stay the one a checkpoint takes."""
        try:
            if isinstance(epoch, bool):
                raise TypeError
            epoch = operator.index(epoch)  # numpy's integers too
        except TypeError:
            raise TypeError(f"epoch must be an int, got {epoch!r}") from None
        if running is not None and epoch == running and self.next == running + 1:
            return False
        if epoch < 0 or (self._limit is not None and epoch >= self._limit):
            bound = "non-negative" if self._limit is None else f"in 0..{self._limit}"
            raise ValueError(f"epoch must be {bound}, got {epoch}")
        # The epoch after it must fit below the pending bit too.
        if epoch >= PENDING - 1:
            raise ValueError(f"epoch must be below 2**63 - 1, got {epoch}")
        changed = epoch != self.next
        if self._resume_epoch is not None and epoch != self._resume_epoch:
            self.resume = self._resume_epoch = None
        kept = self.resume is not None and self._entry() & PENDING
        self._set_next(epoch | (PENDING if kept else 0))
        return changed

    def started(self, epoch: int) -> None:
        """An iteration opened ``epoch`` (a resumed one, its state's): the
        next streams the epoch after it, and the pending resume is used up.
        Raises ``ValueError`` for an epoch past the last (reached by going
        on from the last): it would wrap round to an earlier one."""
        last = min(PENDING - 2, self._limit - 1 if self._limit is not None else PENDING)
        if epoch > last:
            raise ValueError(
                f"epoch {epoch} is past the last one, {last}: set_epoch to an earlier epoch"
            )
        self._set_next(epoch + 1)
        if self.worker_entry() is not None:
            self._table.mark_worker_began()
        self.resume = self._resume_epoch = None
        self._began_in = os.getpid()

    def check_state_known(self, what: str) -> None:
        """Raises ``StateMismatchError`` in a process that is no worker
        (a DataLoader's main process) once workers began an iteration that
        this process did not set up since (``set_epoch``, ``load_state_dict``
        or an iteration of its own): it does not see how far they got, so
        a state taken here would describe a stream the consumer did not
        read, and a resume from it would leave out what they had yet to
        hand out. ``what``: the class whose ``state_dict`` was called."""
        if self.worker_entry() is not None or not self._table.worker_began():
            return
        raise StateMismatchError(
            f"{what}.state_dict() in a process whose DataLoader workers iterate the dataset: "
            "this process does not see how far they got, and a state taken here would leave "
            "out what they had yet to hand out. Save the loader's state instead (torchdata's "
            "StatefulDataLoader: loader.state_dict()), or iterate with num_workers=0; between "
            f"epochs, save the epoch and resume with set_epoch (then {what}.state_dict() "
            "gives that epoch's start)"
        )

    def began_here(self) -> bool:
        """Whether an iteration began in this process before (a copy made
        for another process by fork or pickle does not count it there)."""
        return self._began_in == os.getpid()

    def load(self, resume: Resume, epoch: int, finished: bool) -> None:
        """A state of ``epoch`` was loaded: the next iteration resumes it, or,
        when the state had finished its epoch, streams the one after."""
        self.resume, self._resume_epoch = resume, epoch
        self._set_next((epoch + 1 if finished else epoch) | PENDING)

    def _set_next(self, epoch: int) -> None:
        """Makes ``epoch`` the epoch of the next iteration: of every process
        sharing the table when called outside a worker; in a worker, of this
        worker (and of the worker ids its DataLoader does not use, so that a
        later DataLoader with more workers agrees)."""
        entry = self.worker_entry()
        if entry is None:
            self._table.set_all(epoch)
        else:
            self._table.set_worker(entry[0], entry[1], epoch)

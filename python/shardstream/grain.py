"""Grain: a ``StreamingDataset`` or ``Mix`` as a ``grain.IterDataset``.

``shardstream.grain.StreamSource(dataset)`` is the source of a Grain
pipeline (``grain.IterDataset`` transformations, ``batch``, packing,
``mp_prefetch``, checkpointing). Its iterator's ``get_state``/``set_state``
are the dataset's exact state, so a Grain checkpoint (``get_state`` JSON,
Orbax's ``save``/``load``) resumes at the sample where it was taken.

- Ranks: the dataset's own (``rank``/``world_size``, ``torch.distributed``
  or ``RANK``/``WORLD_SIZE``); Grain has no rank of its own to give.
- ``mp_prefetch(MultiprocessingOptions(num_workers=K))``: Grain slices its
  source for each of its K processes; each takes worker slot ``i`` of ``K``
  of the plan (as a DataLoader worker would), so the processes read
  disjoint shards and samples. A state taken with K processes resumes with
  K (``elastic_state`` of the worker states into the dataset for another K).
- Epochs: every iterator of the source streams its epoch (the dataset's at
  construction, 0 for a new one); ``source.set_epoch(e)`` before each
  epoch's ``iter(pipeline)`` picks the next. (Grain makes iterators of the
  source for its own bookkeeping, in the main process too, so iterators
  cannot count epochs.) Iterators are lazy: nothing is read until the
  first element.

Importing this module imports ``grain``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grain  # type: ignore[import-untyped]

if TYPE_CHECKING:
    from .dataset import StreamingDataset
    from .mix import Mix

__all__ = ["StreamSource"]

EPOCH_START = "shardstream.grain.epoch_start"
"""The ``format`` of the state of an iterator that has handed out nothing:
``{"format": EPOCH_START, "epoch": e}``. Grain asks for such states in its
own process, where the source is not yet given its ``mp_prefetch`` slot, so
they name the epoch, not a slot."""


class StreamSource(grain.IterDataset):  # type: ignore[misc]
    """A ``StreamingDataset`` or ``Mix`` as the source of a Grain pipeline."""

    def __init__(self, dataset: StreamingDataset | Mix) -> None:
        if not (hasattr(dataset, "state_dict") and hasattr(dataset, "load_state_dict")):
            raise TypeError(
                f"StreamSource takes a shardstream StreamingDataset or Mix, got "
                f"{type(dataset).__name__}"
            )
        super().__init__()
        self.dataset = dataset
        self.epoch = dataset.epoch

    def set_epoch(self, epoch: int) -> None:
        """The epoch the iterators made from now on stream."""
        self.dataset.set_epoch(epoch)
        self.epoch = epoch

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Takes worker slot ``sl.start`` of ``sl.step``: what ``mp_prefetch``
        asks of each of its processes (``slice(i, None, K)``)."""
        worker, workers = sl.start or 0, sl.step or 1
        if sl.stop is not None or not 0 <= worker < workers:
            raise ValueError(
                f"StreamSource can take one worker slot of the plan (slice(i, None, K) with "
                f"0 <= i < K), got {sl}"
            )
        from .dataset import StreamingDataset

        # A Mix's streams take the slot (a Mix reads its slot from them).
        dataset = self.dataset
        streams = [dataset] if isinstance(dataset, StreamingDataset) else list(dataset.datasets)
        for ds in streams:
            ds.worker_id, ds.num_workers = worker, workers
            # This process reads the slot: it advances its own epochs.
            ds._epochs.pipe_worker = (worker, workers)
        self.dataset._epochs.pipe_worker = (worker, workers)

    def __iter__(self) -> StreamIterator:
        return StreamIterator(self.dataset, self.epoch)

    def __str__(self) -> str:
        return f"StreamSource({self.dataset!r})"


class StreamIterator(grain.DatasetIterator):  # type: ignore[misc]
    """One epoch of the dataset, with its exact state; opened at the first
    element (or ``get_state``), resumed by ``set_state``."""

    def __init__(self, dataset: StreamingDataset | Mix, epoch: int) -> None:
        super().__init__()
        self._dataset = dataset
        self._epoch = epoch
        self._resume: dict[str, Any] | None = None
        self._samples: Iterator[Any] | None = None

    def _open(self) -> Iterator[Any]:
        resume, self._resume = self._resume, None
        if resume is not None and resume.get("format") == EPOCH_START:
            self._epoch = int(resume["epoch"])
            resume = None
        if resume is not None:
            self._dataset.load_state_dict(resume)
        else:
            self._dataset.set_epoch(self._epoch)
        self._samples = iter(self._dataset)
        return self._samples

    def __next__(self) -> Any:
        samples = self._samples if self._samples is not None else self._open()
        return next(samples)

    def get_state(self) -> dict[str, Any]:
        """The dataset's state: where the stream is (JSON-serialisable)."""
        if self._samples is None:
            if self._resume is not None:
                return dict(self._resume)
            return {"format": EPOCH_START, "epoch": self._epoch}
        return self._dataset.state_dict()

    def set_state(self, state: dict[str, Any]) -> None:
        """Resumes the stream where ``state`` was taken (at the next element)."""
        self._resume = dict(state)
        self._samples = None

"""``Mix``: a weighted mixture of ``StreamingDataset`` streams, with exact and
elastic resume (see ``docs/mixing.md``)."""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from ._core import (
    MIX_FORMAT,
    MIX_PASS_STRIDE,
    DatasetSpecError,
    MixSlot,
    SampleStream,
    SharedWeights,
    StateMismatchError,
    check_mix,
    check_mix_state,
    mix_counts,
    raise_malloc_thresholds,
)
from .dataset import (
    SKIPPED,
    StreamingDataset,
    apply_transform,
    check_worker_count,
    goes_on_to_next_epoch,
    in_worker_raising_at_next,
    start_next_of,
)
from .epochs import EpochAdvance
from .resplit import check_not_resplit, find_splitter
from .state import elastic_slots
from .telemetry import exposition
from .worker_sharing import check_worker_start

__all__ = ["MIX_FORMAT", "Mix"]

# A slot's mixture (its plan, its position, its state and the checks of a
# resumed one) is ``MixSlot``, in Rust (src/state/mix.rs, src/plan/mix.rs):
# pass ``p`` (a restart) of a stream in mixture epoch ``e`` reads the
# stream's epoch ``e + p * MIX_PASS_STRIDE``.

# Mixture weights: a list of numbers, or a one-dimensional array or tensor.
Weights = Sequence[float] | np.ndarray | torch.Tensor

_Slot = tuple[int, int, int, int]  # (rank, world_size, worker_id, num_workers)
_Opener = Callable[[int, int, str | None], SampleStream]
# What every ``MixSlot`` constructor takes first: (open, streams, policy, seed, slot).
_Mixture = tuple[_Opener, int, str, int, _Slot]
# The next epoch's streams opened early: (process id, epoch, slot, every
# stream's planned samples, every stream's pass 0 by (stream, epoch), those
# the mixture takes samples of started).
_StartedStreams = tuple[int, int, _Slot, list[int | None], dict[tuple[int, int], SampleStream]]


def _stream_opener(
    datasets: Sequence[StreamingDataset],
    slot: _Slot,
    started: dict[tuple[int, int], SampleStream] | None = None,
) -> _Opener:
    """What ``MixSlot`` opens the streams of ``slot`` with: stream ``s``'s
    ``epoch``, or its ``resume`` state. ``started``: streams of ``slot``
    already opened (and maybe started), by ``(s, epoch)``, each handed out
    (once) instead of opening that stream's epoch. It holds the streams, not the ``Mix``
    (which holds the iterator): no reference cycle keeps the streams'
    threads alive once the iterator is dropped."""
    datasets = tuple(datasets)
    started = {} if started is None else started

    def open_stream(s: int, epoch: int, resume: str | None) -> SampleStream:
        stream = started.pop((s, epoch), None) if resume is None else None
        if stream is not None:
            return stream
        # A packed stream hands out the sequences its token counts plan, on
        # one rank too: the mixture's order is planned from those numbers.
        return datasets[s].slot_stream(epoch, resume, slot, plan_sequences=True)

    return open_stream


class Mix(IterableDataset[Any]):
    """A weighted mixture of ``StreamingDataset`` streams.

    Each stream keeps its own plan (its shards split across ranks and
    workers before any byte is read, each sample once per stream epoch);
    the order in which a slot takes samples from the streams is computed in
    Rust from ``(seed, epoch, slot)``. Every data-parallel rank takes the
    same number of samples, so DDP never waits on a rank that ran out.

    Args:
        datasets: the streams, ``StreamingDataset`` objects with the same
            layout arguments (``rank``, ``world_size``, ``model_parallel_size``,
            ...) and sample counts (local tar shards are counted, others need a
            manifest). Their own ``seed`` and shuffle options shape their
            plans; each one's ``transform`` runs on its samples as they leave
            the mixture (its ``on_error`` applies to an exception in it), and
            the mixture's state and resume are the same as without it.
            Packed streams (``pack``, one sequence shape, token counts in
            the manifest) mix their sequences: by token weight.
        weights: one finite, non-negative weight per stream, at least one
            above 0 (a list, or a one-dimensional numpy array or tensor);
            only their ratios count (``[1e308, 1e308]`` mixes as
            ``[1, 1]``); equal by default.
        policy: when a stream runs out, ``"stop"`` ends the epoch (the
            other streams' rest is left unread), ``"restart"`` starts it again
            with its next epoch order until the longest-lasting stream is
            done, ``"continue"`` goes on with the others, weights
            renormalised, until every stream is done.
        seed: seed of the mixture order (the first stream's ``seed`` by
            default).
    """

    def __init__(
        self,
        datasets: Sequence[StreamingDataset],
        weights: Weights | None = None,
        *,
        policy: str = "stop",
        seed: int | None = None,
    ) -> None:
        super().__init__()
        datasets = list(datasets)
        if not datasets or not all(isinstance(d, StreamingDataset) for d in datasets):
            raise TypeError("datasets must be a non-empty list of shardstream.StreamingDataset")
        if not isinstance(policy, str):
            raise TypeError(f"invalid option policy: expected a str, got {policy!r}")
        if weights is None:
            weights = [1.0] * len(datasets)
        weights = self._check_weights(weights, len(datasets), policy)
        if seed is None:
            seed = int(datasets[0].options["seed"])
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
            raise ValueError(f"invalid option seed: expected an int in 0..2**64, got {seed!r}")
        first = datasets[0]
        for i, ds in enumerate(datasets):
            if ds.options.batches:
                raise ValueError(
                    f"stream {i} hands out batches (batch_size or batch_format); a mixture "
                    "takes samples: batch them with the DataLoader"
                )
            _check_same_pack(i, ds.options["pack"], first.options["pack"])
            for name in ("rank", "world_size", "num_workers", "worker_id"):
                if getattr(ds, name) != getattr(first, name):
                    raise ValueError(
                        f"stream {i} has {name}={getattr(ds, name)!r}, stream 0 "
                        f"{getattr(first, name)!r}: the streams of a mixture share one layout"
                    )
            if ds.options["model_parallel_size"] != first.options["model_parallel_size"]:
                raise ValueError(
                    f"stream {i} has model_parallel_size={ds.options['model_parallel_size']}, "
                    f"stream 0 {first.options['model_parallel_size']}: the streams of a "
                    "mixture share one layout"
                )
            ds.shard_list.count_samples()
            if ds.shard_list.sample_counts is None:
                raise DatasetSpecError(
                    f"stream {i} of the mixture ({' '.join(ds.shard_list.urls[:1])}...): a "
                    "mixture needs every shard's sample count for equal ranks and exact "
                    "proportions; local tar shards are counted, compressed and remote ones "
                    "need a manifest (run `shardstream index SPEC -o DIR/manifest.json`)"
                )
        for ds in datasets:
            # A packed stream's sequences are planned from its token counts.
            ds.shard_list.check_equal_length(ds.distributed_slot()[1], mixture=True)
        self.datasets = datasets
        # Shared with DataLoader workers, persistent ones included, so that
        # set_weights reaches their next epoch.
        self._weights = SharedWeights(weights)
        self.policy = policy
        self.seed = seed
        self._epochs: EpochAdvance[tuple[str, Any, list[float] | None]] = EpochAdvance(
            MIX_PASS_STRIDE
        )
        self._iterator: _MixIterator | None = None
        # The epoch ``set_epoch`` set while an iterator of it was read: the
        # next iteration's if that iterator is left before its end.
        self._again: int | None = None
        # The next epoch's streams, opened (and started where the mixture
        # takes samples of them) in a persistent DataLoader worker when this
        # epoch's mixture ended; see ``_start_next``.
        self._next_streams: _StartedStreams | None = None

    @staticmethod
    def _check_weights(weights: Any, streams: int, policy: str) -> list[float]:
        # A one-dimensional numpy array or tensor (a schedule's output):
        # its numbers, as Python's.
        if isinstance(weights, (np.ndarray, torch.Tensor)) and weights.ndim == 1:
            weights = weights.tolist()
        if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
            raise TypeError(f"invalid option weights: expected a list of numbers, got {weights!r}")
        # numbers.Real takes numpy's scalars (np.float32, np.int64) too.
        if not all(
            isinstance(w, numbers.Real) and not isinstance(w, (bool, np.bool_)) for w in weights
        ):
            raise TypeError(f"invalid option weights: expected a list of numbers, got {weights!r}")
        if len(weights) != streams:
            raise ValueError(
                f"invalid option weights: {len(weights)} weights for {streams} streams"
            )
        try:
            floats = [float(w) for w in weights]
        except OverflowError:
            raise ValueError(
                f"invalid option weights: {weights!r}: a weight is too large for a float"
            ) from None
        check_mix(policy, floats)
        return floats

    @property
    def weights(self) -> list[float]:
        """The weights of the next iteration's epoch."""
        return self._weights.get(self.epoch)

    def _epoch_weights(self, epoch: int) -> list[float]:
        """The weights ``epoch`` mixes by (``set_weights`` gives them from
        the first epoch no iteration had begun when it was called)."""
        return self._weights.get(epoch)

    def set_weights(self, weights: Weights) -> None:
        """Sets the weights of the next iteration's epoch and the ones after
        it, in this process and in its DataLoader workers (persistent ones
        too): from the first epoch no iteration has begun (an iteration under
        way keeps its weights, in workers that start it late too, and one
        that resumes a loaded state keeps the state's). The epochs before
        mix by the weights the epoch before that one had. To change them in
        the middle of an epoch, resume with ``load_state_dict(elastic_state,
        weights=...)``."""
        checked = self._check_weights(weights, len(self.datasets), self.policy)
        self._weights.set(checked, self._first_unstarted_epoch())

    def _first_unstarted_epoch(self) -> int:
        """The first epoch no iteration has begun, in this process or its
        workers: ``set_weights`` changes the weights from there on. An
        epoch whose iteration resumes a loaded state keeps that state's
        weights."""
        epoch = self._epochs.furthest
        resume = self._epochs.pending()
        if resume is not None:
            kind, state, _ = resume
            resumed = state[0] if kind == "elastic" else state
            if int(resumed["epoch"]) == epoch:
                return epoch + 1
        return epoch

    # -- epochs ----------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch of this process's next iteration (see
        ``StreamingDataset.epoch``)."""
        return self._epochs.next

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch of the next iteration (then ``epoch + 1``, ...):
        pass 0 of every stream reads that stream's epoch ``epoch``. Calling
        it with another epoch than a pending resume's drops the resume.
        With an iterator being read, or made and not read yet, as
        ``StreamingDataset.set_epoch``."""
        self._again = None
        iterator = self._iterator
        state = iterator.state() if iterator is not None else None
        if iterator is None or state is None or state["finished"]:
            if self._epochs.set(epoch):
                self._iterator = None
            return
        if state["position"] or epoch == iterator.epoch:
            # The mixture being read stays the one a state describes (and
            # the next iteration's epoch if it is left before its end).
            self._epochs.set(epoch, running=iterator.epoch)
            self._again = epoch if epoch == iterator.epoch else None
            return
        # An iterator made and not read yet (StatefulDataLoader makes one
        # to take its first state): it streams the epoch set now.
        self._epochs.set(epoch)
        iterator.retarget(self._mix_slot(self.epoch, self._slot()))
        self._epochs.started(iterator.epoch)

    # -- iteration -------------------------------------------------------

    def _slot(self) -> _Slot:
        rank, world_size = self.datasets[0].distributed_slot()
        worker_id, num_workers = self.datasets[0].worker_slot()
        return rank, world_size, worker_id, num_workers

    def __iter__(self) -> Iterator[Any]:
        return in_worker_raising_at_next(self._iterate, self._epochs)

    def _iterate(self) -> Iterator[Any]:
        """``__iter__``'s iterator, what stops it raised here."""
        # Accelerate's wrappers would split this rank's part between ranks again.
        check_not_resplit(self, self.datasets[0].distributed_slot()[1])
        for ds in self.datasets:
            ds.check_worker_count()
        if any(ds.options["raise_malloc_thresholds"] for ds in self.datasets):
            # The process that iterates makes each sample's ``bytes``.
            raise_malloc_thresholds()
        again, self._again = self._again, None
        iterator = self._iterator
        if again is not None and iterator is not None and not iterator.state()["finished"]:
            # The iterator of the epoch set last was left before its end.
            self._epochs.set(again)
        slot = self._slot()
        started = self._started_next(slot)
        iterator = _MixIterator(self.datasets, self._mix_slot(self.epoch, slot, started))
        early = any(ds.options["read_next_epoch_early"] for ds in self.datasets)
        if early and goes_on_to_next_epoch(self._epochs):
            iterator.on_end = start_next_of(self)
        self._epochs.started(iterator.epoch)
        self._iterator = iterator
        return iterator

    def _start_next(self) -> None:
        """Called when the epoch's mixture ends in a process that goes on to
        the next epoch (``goes_on_to_next_epoch``): opens and starts pass 0
        of the next epoch of every stream the next epoch's mixture takes
        samples of in this slot (and whose
        dataset has ``read_next_epoch_early``), so that their reads run
        while the other workers and the training loop finish the epoch. A
        stream's pass 0 is the stream's own epoch whatever the weights, so
        ``set_weights`` between the epochs keeps it valid; the next
        ``__iter__`` takes the streams (and the other streams' pass 0,
        opened and not started) if it begins that epoch in this slot
        (``_started_next``). Nothing it meets stops the epoch that ended:
        a stream that cannot be opened or started now is opened again by
        the next epoch's mixture, which raises what stops it."""
        self._next_streams = None
        try:
            if self._epochs.pending() is not None:
                return
            epoch, slot = self.epoch, self._slot()
            # Every stream's pass 0, not started yet, as the mixture opens
            # them: their counts say which streams it takes samples of.
            opened = [
                ds.slot_stream(epoch, None, slot, plan_sequences=True) for ds in self.datasets
            ]
            available = [stream.planned_samples for stream in opened]
            takes = self._takes(self._epoch_weights(epoch), available)
            streams: dict[tuple[int, int], SampleStream] = {}
            for s, stream in enumerate(opened):
                early = takes[s] > 0 and self.datasets[s].options["read_next_epoch_early"]
                # A stream whose threads could not start is opened again by
                # the mixture; one not started is what the mixture would
                # open, so that no stream is planned twice.
                if not early or stream.start():
                    streams[(s, epoch)] = stream
        except Exception:
            return
        self._next_streams = (os.getpid(), epoch, slot, available, streams)

    def _takes(self, weights: list[float], available: list[int | None]) -> list[float]:
        """How many samples a slot's mixture takes of each stream whose
        pass 0 gives ``available`` samples, under ``weights`` (the weights
        themselves where a count is not known)."""
        known = [n for n in available if n is not None]
        if len(known) < len(available):
            return weights
        return [float(n) for n in mix_counts(self.policy, weights, known)]

    def _started_next(self, slot: _Slot) -> dict[tuple[int, int], SampleStream] | None:
        """The streams ``_start_next`` opened, if the next iteration
        begins their epoch fresh in ``slot`` and this process (not after
        ``set_epoch`` to another epoch, nor with a loaded state pending),
        without the started ones the epoch's mixture no longer takes
        samples of (its weights changed). Either way they are no longer
        kept."""
        started, self._next_streams = self._next_streams, None
        if started is None:
            return None
        pid, epoch, started_slot, available, streams = started
        if (
            pid != os.getpid()
            or self._epochs.pending() is not None
            or epoch != self.epoch
            or started_slot != slot
        ):
            return None
        try:
            takes = self._takes(self._epoch_weights(epoch), available)
        except Exception:
            # The mixture raises it when it is made.
            return None
        return {
            key: stream
            for key, stream in streams.items()
            if takes[key[0]] > 0 or not stream.started
        }

    def _mixture(
        self, slot: _Slot, started: dict[tuple[int, int], SampleStream] | None = None
    ) -> _Mixture:
        """What every ``MixSlot`` constructor takes first, for ``slot``
        (``started``: streams already opened, see ``_stream_opener``)."""
        return (
            _stream_opener(self.datasets, slot, started),
            len(self.datasets),
            self.policy,
            self.seed,
            slot,
        )

    def _mix_slot(
        self,
        epoch: int,
        slot: _Slot,
        started: dict[tuple[int, int], SampleStream] | None = None,
    ) -> MixSlot:
        """``slot``'s mixture of ``epoch``, or of a pending resume
        (``started``: streams already opened, see ``_stream_opener``)."""
        mixture = self._mixture(slot, started)
        resume = self._epochs.pending()
        if resume is None:
            return MixSlot.fresh(*mixture, self._epoch_weights(epoch), epoch)
        kind, state, weights = resume
        if kind == "exact":
            # The rest of this slot's epoch from its own state.
            return MixSlot.exact(*mixture, json.dumps(state))
        # The rest of the saved job's epoch, split anew for this layout.
        return MixSlot.elastic(*mixture, json.dumps(state), weights)

    # -- state -----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The state of this process's mixture as of the last sample it
        handed out: the mixture's position and each stream's state. In a
        DataLoader's main process once its workers began iterating (and no
        ``set_epoch`` or ``load_state_dict`` came since), a
        ``StateMismatchError``: the workers' progress is not known there."""
        self._epochs.check_state_known("Mix")
        iterator = self._iterator
        if iterator is None:
            iterator = _MixIterator(self.datasets, self._mix_slot(self.epoch, self._slot()))
        return iterator.state()

    def load_state_dict(
        self, state_dict: Mapping[str, Any], *, weights: Weights | None = None
    ) -> None:
        """Resumes from a state at the next ``__iter__``.

        ``state_dict`` is one slot's mixture state (``StatefulDataLoader``,
        same layout: the rest of the epoch comes exactly as it would have),
        or ``shardstream.elastic_state(...)`` of every slot of a job (any
        new world size and ``num_workers``: each stream's samples not yet
        handed out come at most once, and all of them under
        ``policy="continue"``, but for what a packed stream leaves out past
        its planned sequences). ``weights`` changes the weights from here on
        (with an elastic state: the rest of each stream is split anew, so
        ranks stay equal); without it the state's weights are kept, and
        must be this mixture's.
        """
        new_weights = (
            None
            if weights is None
            else self._check_weights(weights, len(self.datasets), self.policy)
        )
        if not isinstance(state_dict, Mapping):
            raise StateMismatchError(
                f"not a shardstream.Mix state: expected a dict, got {type(state_dict).__name__}"
            )
        slots = elastic_slots(state_dict)
        if slots is not None:
            states = [self._check_form(s, f"slots[{i}].") for i, s in enumerate(slots)]
            kind = "elastic"
            epoch = int(states[0]["epoch"])
            # As a dataset's: every slot at its end leaves nothing to resume.
            finished = all(bool(s["finished"]) for s in states)
            resume: Any = states
        else:
            state = self._check_form(state_dict, "")
            check_worker_count(state, self.datasets[0].num_workers)
            if new_weights is not None and new_weights != state["weights"]:
                raise StateMismatchError(
                    "state field weights: changing the weights at a resume splits each "
                    "stream's rest anew, which needs every slot's state: pass "
                    "shardstream.elastic_state(...) of the whole job"
                )
            kind, epoch, finished, resume = "exact", int(state["epoch"]), state["finished"], state
        if new_weights is None:
            saved = [s["weights"] for s in (resume if kind == "elastic" else [resume])]
            mine = self._epoch_weights(epoch)
            if any(w != mine for w in saved):
                raise StateMismatchError(
                    f"state field weights: the state's weights {saved[0]} are not this "
                    f"mixture's {mine}; pass weights= to change them"
                )
        else:
            self._weights.set(new_weights, epoch)
        self._iterator = self._again = None
        self._epochs.load((kind, resume, new_weights), epoch, finished)

    def _check_form(self, state: Any, prefix: str) -> dict[str, Any]:
        """Checks the mixture fields of a state (``src/state/mix.rs``; the
        streams' own states are checked by the core when opened); a copy."""
        try:
            text = json.dumps(state)
        except (TypeError, ValueError) as error:
            raise StateMismatchError(
                f"not a shardstream.Mix state: not JSON data ({error})"
            ) from None
        check_mix_state(text, self.policy, self.seed, len(self.datasets), prefix)
        checked: dict[str, Any] = json.loads(text)
        return checked

    def num_samples(self, num_workers: int | None = None) -> int:
        """Samples this rank takes in the next epoch from ``num_workers``
        DataLoader workers (``0``: the main process reads, as with 1;
        default: the ``num_workers`` argument of the streams, else 1); the
        same on every data-parallel rank (sequences, for packed streams).
        Under ``"stop"`` it may depend on ``num_workers`` by a few samples
        (rounding per worker)."""
        rank, world_size, _, workers = self._slot()
        if num_workers is not None:
            if not isinstance(num_workers, int) or isinstance(num_workers, bool):
                raise TypeError(f"num_workers must be an int, got {num_workers!r}")
            if num_workers < 0:
                raise ValueError(
                    f"num_workers must be 0 (the main process reads) or more, got {num_workers}"
                )
            # 0: the main process reads, as one worker does.
            workers = max(num_workers, 1)
        epoch = self.epoch
        weights = self._epoch_weights(epoch)
        return sum(
            len(MixSlot.fresh(*self._mixture((rank, world_size, w, workers)), weights, epoch))
            for w in range(workers)
        )

    def stats(self, reset: bool = False) -> list[dict[str, int]]:
        """Each stream's counters (see ``StreamingDataset.stats``); with
        ``reset=True``, each one's window since the last reset."""
        return [ds.stats(reset) for ds in self.datasets]

    def stats_text(self, reset: bool = False) -> str:
        """``stats(reset)`` in the Prometheus text exposition format, each
        stream's samples labelled ``stream="<index>"``."""
        return exposition([({"stream": str(i)}, s) for i, s in enumerate(self.stats(reset))])

    def __getstate__(self) -> dict[str, Any]:
        check_worker_start()
        state = self.__dict__.copy()
        state["_iterator"] = state["_next_streams"] = None
        # As for StreamingDataset: the wrapper a spawned worker cannot see.
        state["_pickled_under"] = find_splitter(self)
        return state

    def __repr__(self) -> str:
        return (
            f"Mix({len(self.datasets)} streams, weights={self.weights}, "
            f"policy={self.policy!r}, seed={self.seed}, epoch={self.epoch})"
        )


def mixture_shards(datasets: Sequence[StreamingDataset]) -> tuple[list[int], int]:
    """How a mixture's ``__id__`` numbers its shards: pass ``p`` over stream
    ``s``'s shard ``k`` is shard ``p * total + offsets[s] + k``, where
    ``offsets[s]`` counts the shards of the streams before ``s`` and
    ``total`` those of every stream (``shardstream verify`` reads them
    back the same way, src/ledger/verify_mix.rs)."""
    offsets = []
    total = 0
    for ds in datasets:
        offsets.append(total)
        total += len(ds.shard_list)
    return offsets, total


def mixture_id(id_shards: tuple[list[int], int], s: int, epoch: int, shard: int) -> tuple[int, int]:
    """The mixture's epoch and shard of stream ``s``'s ``epoch`` (a pass's,
    ``e + p * MIX_PASS_STRIDE``) and ``shard``, numbered as
    ``mixture_shards`` gives ``id_shards``: pass ``p`` over the stream's
    shard ``k`` is shard ``p * total + offsets[s] + k``."""
    offsets, total = id_shards
    pass_, mixture_epoch = divmod(epoch, MIX_PASS_STRIDE)
    return mixture_epoch, pass_ * total + offsets[s] + shard


def _check_same_pack(i: int, pack: Any, first: Any) -> None:
    """Raises ``ValueError`` unless stream ``i``'s ``pack`` gives sequences
    of the first stream's form: a mixture of packed streams mixes their
    sequences (so its weights are token weights), one of unpacked streams
    their samples."""
    if (pack is None) != (first is None):
        which = "packs its documents" if pack is not None else "does not pack its documents"
        raise ValueError(
            f"invalid option pack: stream {i} {which} and stream 0 "
            f"{'does not' if first is None else 'does'}: a mixture mixes packed sequences "
            "or samples, not both"
        )
    if pack is not None and (pack.seq_len, pack.labels) != (first.seq_len, first.labels):
        raise ValueError(
            f"invalid option pack: stream {i} packs sequences of seq_len={pack.seq_len}, "
            f"labels={pack.labels}, stream 0 of seq_len={first.seq_len}, "
            f"labels={first.labels}: a mixture's sequences have one shape"
        )


class _MixIterator:
    """One slot's mixture for one epoch (a ``MixSlot``), with each stream's
    own transform run on its samples as they leave the mixture: the
    mixture's state is the same with or without them."""

    def __init__(self, datasets: Sequence[StreamingDataset], mix_slot: MixSlot) -> None:
        self.datasets = list(datasets)
        self.mix_slot = mix_slot
        self.epoch = mix_slot.epoch
        self.transforms = [ds.options["transform"] for ds in self.datasets]
        self.id_shards = mixture_shards(self.datasets)
        # Called once when the mixture ends (not when it fails).
        self.on_end: Callable[[], None] | None = None

    def _mixture_id(self, s: int, sample: Any) -> None:
        """Rewrites ``sample``'s ``__id__`` (its stream's epoch, shard and
        index) as the mixture's: the mixture's epoch, and the shard
        numbered across the streams and passes (see ``mixture_shards``).
        A packed sequence's ``(K, 3)`` rows (of its stream's epoch, its
        ``__epoch__``) are rewritten alike, and its ``__epoch__``."""
        ids = sample.get("__id__") if type(sample) is dict else None
        if ids is None:
            return
        if isinstance(ids, np.ndarray):
            stream_epoch = int(sample["__epoch__"][0])
            epoch, offset = mixture_id(self.id_shards, s, stream_epoch, 0)
            rows = ids.copy()
            rows[:, 0] = epoch
            rows[:, 1] += offset
            sample["__id__"] = rows
            sample["__epoch__"] = np.array([epoch], dtype=np.int64)
            return
        epoch, shard, index = ids
        sample["__id__"] = (*mixture_id(self.id_shards, s, epoch, shard), index)

    def __iter__(self) -> _MixIterator:
        return self

    def __next__(self) -> Any:
        for s, sample in self.mix_slot:
            ds = self.datasets[s]
            if not ds._decode_checked:
                ds.check_decode_fields(sample)
            self._mixture_id(s, sample)
            transform = self.transforms[s]
            if transform is None:
                return sample
            skip = ds.options["on_error"] == "warn"
            sample = apply_transform(transform, sample, skip, ds._counters, ds.skip_log)
            if sample is not SKIPPED:
                return sample
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end()
        raise StopIteration

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = json.loads(self.mix_slot.state())
        return state

    def retarget(self, mix_slot: MixSlot) -> None:
        """Reads ``mix_slot`` instead (this iterator has handed out nothing)."""
        self.mix_slot = mix_slot
        self.epoch = mix_slot.epoch

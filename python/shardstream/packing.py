"""``collate_sequences``: the DataLoader's own batching of packed sequences
(``pack=Pack(...)``), laid out as Rust batches (``batch_size=`` on the
dataset) lay them out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["collate_sequences"]

# Fields whose length differs from sequence to sequence.
_BOUNDS = "cu_seqlens"
_IDS = "__id__"


def collate_sequences(sequences: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Batches packed sequences as ``DataLoader(ds, batch_size=N,
    collate_fn=shardstream.collate_sequences)``: ``input_ids``,
    ``position_ids`` and ``labels`` (with ``labels=True``) stacked into
    ``(N, width)`` tensors (``__epoch__`` into ``(N, 1)``) by torch's
    ``default_collate``, ``cu_seqlens`` joined into one ``int32`` tensor of
    bounds over the batch's ``N * width`` tokens end to end (the layout of
    variable-length attention kernels), ``__id__`` rows joined into one
    ``(K, 3)`` tensor: the batch Rust batches of ``N`` give. ``ValueError``
    when the items are not packed sequences of one width."""
    from torch import from_numpy
    from torch.utils.data import default_collate

    if not sequences or not all(
        isinstance(s, Mapping)
        and _BOUNDS in s
        and "position_ids" in s
        and np.ndim(s["position_ids"]) == 1
        for s in sequences
    ):
        raise ValueError(
            "collate_sequences batches packed sequences (pack=Pack(...), not Rust batches): "
            "every item a dict with 1-D position_ids and cu_seqlens"
        )
    widths = {len(s["position_ids"]) for s in sequences}
    if len(widths) != 1:
        raise ValueError(f"collate_sequences: sequences of widths {sorted(widths)}, not one")
    width = widths.pop()
    bounds = [np.asarray(sequences[0][_BOUNDS], dtype=np.int32)]
    for row, sequence in enumerate(sequences[1:], start=1):
        bounds.append(np.asarray(sequence[_BOUNDS], dtype=np.int32)[1:] + row * width)
    stacked: dict[str, Any] = default_collate(
        [{k: v for k, v in s.items() if k not in (_BOUNDS, _IDS)} for s in sequences]
    )
    # The fields in the sequences' order, as Rust batches give them.
    batch: dict[str, Any] = {}
    for name in sequences[0]:
        if name == _BOUNDS:
            batch[name] = from_numpy(np.concatenate(bounds))
        elif name == _IDS:
            rows = [np.asarray(s[_IDS], dtype=np.int64).reshape(-1, 3) for s in sequences]
            batch[name] = from_numpy(np.concatenate(rows))
        else:
            batch[name] = stacked[name]
    return batch

"""Reproducible randomness for Python transforms.

With ``sample_seed=True`` every sample carries ``__seed__``: an int drawn in
Rust from the sample's identity, ``(seed, epoch, shard index, index in the
shard)``, and from nothing else. A transform that draws its random choices
only from ``sample_rng(sample)`` or ``sample_generator(sample)`` gives a
sample the same output whichever rank or DataLoader worker reads it, after an
exact or an elastic resume, and in a ``Mix``; another epoch gives other draws.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["sample_generator", "sample_rng", "sample_seed"]


def sample_seed(sample: Mapping[str, Any]) -> int:
    """The sample's ``__seed__`` (a non-negative int below ``2**63``).

    Raises ``ValueError`` naming the option when the sample has none (the
    dataset was made without ``sample_seed=True``), and ``TypeError`` for a
    collated batch, whose ``__seed__`` holds one seed per sample."""
    if not isinstance(sample, Mapping):
        raise TypeError(f"expected a sample (a dict), got {type(sample).__name__}")
    if "__seed__" not in sample:
        raise ValueError(
            "the sample has no __seed__ field: create the dataset with sample_seed=True "
            "(with a Mix, every dataset whose transform draws from it)"
        )
    seed = sample["__seed__"]
    if isinstance(seed, bool) or not isinstance(seed, int):
        item = getattr(seed, "item", None)
        if getattr(seed, "ndim", None) == 0 and item is not None:
            seed = item()
        else:
            raise TypeError(
                "__seed__ holds one seed per sample (a collated batch): draw from "
                "numpy.random.default_rng(int(s)) for each s in batch['__seed__'], or use "
                "a per-sample transform (without batch_size)"
            )
    return int(seed)


def sample_rng(sample: Mapping[str, Any]) -> np.random.Generator:
    """A ``numpy.random.Generator`` seeded with the sample's ``__seed__``: a
    new one at each call, drawing the same numbers each time."""
    import numpy as np

    return np.random.default_rng(sample_seed(sample))


def sample_generator(sample: Mapping[str, Any]) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with the sample's ``__seed__``: a new
    one at each call, drawing the same numbers each time (pass it as
    ``generator=`` to ``torch.rand``, ``torch.randint``, ...)."""
    import torch

    return torch.Generator().manual_seed(sample_seed(sample))

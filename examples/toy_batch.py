"""The toy batch the training examples share: byte-level features of raw
samples (stand-ins for real decoding) and a target derived from the key."""

from __future__ import annotations

import zlib
from typing import Any

import torch

FEATURES = 3


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Raw samples to a batch: keys, a few byte-level features per sample
    (stand-ins for decoding) and a target derived from the key."""
    features, targets = [], []
    for sample in samples:
        fields = [v for k, v in sample.items() if not k.startswith("__")]
        size = sum(len(v) for v in fields)
        first = fields[0][:1] if fields and fields[0] else b"\0"
        features.append([len(fields) / 4, size / 65536, first[0] / 255])
        targets.append([zlib.crc32(sample["__key__"].encode()) % 1000 / 1000])
    return {
        "keys": [s["__key__"] for s in samples],
        "features": torch.tensor(features, dtype=torch.float32),
        "targets": torch.tensor(targets, dtype=torch.float32),
    }

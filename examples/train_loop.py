"""A minimal training loop over shardstream: DataLoader workers, ``set_epoch``
per epoch, and a collate that decodes WAV + JSON samples into tensors.

    python examples/train_loop.py data/audio --epochs 2 --num-workers 2
"""

from __future__ import annotations

import argparse
import io
import json
import time
import wave
from typing import Any

import torch
from torch.utils.data import DataLoader

from shardstream import StreamingDataset


def decode(sample: dict[str, Any]) -> dict[str, Any]:
    """Decodes one raw sample: 16-bit PCM WAV to float32, JSON to a dict."""
    with wave.open(io.BytesIO(sample["wav"])) as w:
        pcm = torch.frombuffer(bytearray(w.readframes(w.getnframes())), dtype=torch.int16)
        rate = w.getframerate()
    meta = json.loads(sample["json"])
    return {
        "key": sample["__key__"],
        "audio": pcm.to(torch.float32) / 32768.0,
        "rate": rate,
        "label": int(meta["label"]),
    }


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Pads clips to the longest in the batch."""
    decoded = [decode(s) for s in samples]
    audio = torch.nn.utils.rnn.pad_sequence([d["audio"] for d in decoded], batch_first=True)
    return {
        "keys": [d["key"] for d in decoded],
        "audio": audio,
        "labels": torch.tensor([d["label"] for d in decoded]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="dataset spec: directory, brace pattern or path")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    dataset = StreamingDataset(args.data, seed=args.seed, shuffle_buffer=256)
    model = torch.nn.Linear(1, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(args.epochs):
        dataset.set_epoch(epoch)
        loader = DataLoader(
            dataset, batch_size=args.batch_size, num_workers=args.num_workers, collate_fn=collate
        )
        start, samples, loss_sum, batches = time.perf_counter(), 0, 0.0, 0
        for batch in loader:
            features = batch["audio"].abs().mean(dim=1, keepdim=True)
            loss = torch.nn.functional.cross_entropy(model(features), batch["labels"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            samples += len(batch["keys"])
            loss_sum += loss.item()
            batches += 1
        elapsed = time.perf_counter() - start
        print(
            f"epoch {epoch}: {samples} samples in {batches} batches, "
            f"{samples / elapsed:,.0f} samples/s, mean loss {loss_sum / max(batches, 1):.3f}"
        )
    print(f"stats: {dataset.stats()}")


if __name__ == "__main__":
    main()

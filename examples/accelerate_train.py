"""Hugging Face Accelerate's standard loop over a ``StreamingDataset``.

A ``StreamingDataset`` gives each rank its own part of the data, so its
DataLoader goes through ``shardstream.accelerate.prepare_loader`` (device
placement, Accelerate's bookkeeping and ``save_state``/``load_state``, no
second split), while the model and optimizer go through
``accelerator.prepare`` as usual::

    python examples/make_dataset.py /tmp/shards --shards 8 --samples-per-shard 12
    torchrun --standalone --nproc_per_node 2 examples/accelerate_train.py /tmp/shards \\
        --out /tmp/acc-out --epochs 2

(``accelerate launch --num_processes 2 examples/accelerate_train.py ...`` runs
it the same way.) Stop after 5 batches of the first epoch, saving a
checkpoint with ``accelerator.save_state``, then resume from it exactly::

    torchrun ... examples/accelerate_train.py /tmp/shards --out /tmp/a --stop-after 5 \\
        --checkpoint /tmp/ckpt
    torchrun ... examples/accelerate_train.py /tmp/shards --out /tmp/b --resume /tmp/ckpt

``--ledger DIR`` (in every run of a job) writes the sample ledger, resumes
included, and ``shardstream verify DIR`` proves each epoch exactly once.

``--plain-prepare`` passes the DataLoader to ``accelerator.prepare`` instead,
as most Accelerate code does: with several ranks shardstream then raises
``FrameworkWrapperError`` at the first batch, naming the fix (Accelerate
would otherwise train on 1/N of the data).

Each rank writes ``OUT/rank-{rank}.json``: ``{"rank", "world_size",
"epochs": [{"epoch", "batches", "keys"}]}``; the exit status is 1 if the
ranks ran different numbers of batches in an epoch.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from shardstream import StreamingDataset

# How DataLoader workers start in a DDP rank: forked ones can hang as they
# start on CPython before 3.12 (gh-112275; docs/integrations.md), spawned
# ones cannot; from 3.12 on the default (fork) is safe.
WORKER_START = "spawn" if sys.version_info < (3, 12) else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Accelerate's training loop over shardstream.")
    parser.add_argument("data", help="dataset spec (directory, brace pattern, paths)")
    parser.add_argument("--out", type=Path, required=True, help="where to write rank-{rank}.json")
    parser.add_argument("--epochs", type=int, default=2, help="epochs to train (default: 2)")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per batch (default: 4)")
    parser.add_argument(
        "--num-workers", type=int, default=2, help="DataLoader workers (default: 2)"
    )
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (default: 0)")
    parser.add_argument(
        "--plain-prepare",
        action="store_true",
        help="pass the DataLoader to accelerator.prepare (shardstream raises, naming the fix)",
    )
    parser.add_argument(
        "--no-dispatch-batches",
        action="store_true",
        help="DataLoaderConfiguration(dispatch_batches=False) (with --plain-prepare)",
    )
    parser.add_argument(
        "--stateless",
        action="store_true",
        help="a torch DataLoader and use_stateful_dataloader=False (no --stop-after/--resume)",
    )
    parser.add_argument(
        "--stop-after", type=int, help="save a checkpoint after this many batches, then stop"
    )
    parser.add_argument("--checkpoint", type=Path, help="where --stop-after saves the checkpoint")
    parser.add_argument("--resume", type=Path, help="a checkpoint to resume from")
    parser.add_argument(
        "--ledger",
        type=Path,
        help="write the sample ledger there (`shardstream verify LEDGER` checks the run)",
    )
    return parser.parse_args(argv)


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stand-in features (byte counts of the fields) and a target from the key."""
    features, targets = [], []
    for sample in samples:
        sizes = [len(v) for k, v in sorted(sample.items()) if not k.startswith("__")]
        features.append([len(sizes) / 4, sum(sizes) / 65536, sizes[0] / 65536])
        targets.append([zlib.crc32(sample["__key__"].encode()) % 1000 / 1000])
    batch = {
        "keys": [s["__key__"] for s in samples],
        "features": torch.tensor(features),
        "targets": torch.tensor(targets),
    }
    if "__id__" in samples[0]:  # sample_ids=True: what the ledger records
        batch["__id__"] = torch.tensor([s["__id__"] for s in samples])
    return batch


def main(argv: list[str] | None = None) -> int:
    # Imported here, not at the top: spawned DataLoader workers import this
    # script again (to find ``collate``), and need torch, not Accelerate.
    from accelerate import Accelerator, DataLoaderConfiguration

    from shardstream.accelerate import prepare_loader

    args = parse_args(argv)
    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(
            # StatefulDataLoader under the hood: save_state keeps the loader's state.
            use_stateful_dataloader=not args.stateless,
            dispatch_batches=False if args.no_dispatch_batches else None,
        ),
        cpu=not torch.cuda.is_available(),
    )
    dataset = StreamingDataset(
        args.data, seed=args.seed, shuffle_buffer=16, sample_ids=args.ledger is not None
    )
    loader_class = DataLoader if args.stateless else StatefulDataLoader
    loader = loader_class(
        dataset,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        collate_fn=collate,
        multiprocessing_context=WORKER_START if args.num_workers else None,
        # Spawned workers start once, not at every epoch (each imports
        # torch anew); epochs advance in them by themselves.
        persistent_workers=args.num_workers > 0,
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if args.plain_prepare:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
        # With a ledger, save_state/load_state keep its resume step too.
        loader = prepare_loader(accelerator, loader, ledger_dir=args.ledger)

    first_epoch = 0
    if args.resume is not None:
        accelerator.load_state(str(args.resume))  # the loader's state too: each rank its own
        first_epoch = json.loads((args.resume / "progress.json").read_text())["epoch"]

    epochs, batches_seen = [], 0
    for epoch in range(first_epoch, args.epochs):
        loader.set_epoch(epoch)  # the dataset's epoch follows the loop's, resumed or not
        batches, keys = 0, []
        for batch in loader:
            assert batch["features"].device.type == accelerator.device.type
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(batch["features"]), batch["targets"])
            accelerator.backward(loss)
            optimizer.step()
            batches += 1
            batches_seen += 1
            keys.extend(batch["keys"])
            if args.stop_after is not None and batches_seen == args.stop_after:
                assert args.checkpoint is not None, "--stop-after needs --checkpoint"
                accelerator.save_state(str(args.checkpoint))  # on every rank
                if accelerator.is_main_process:
                    (args.checkpoint / "progress.json").write_text(json.dumps({"epoch": epoch}))
                break
        epochs.append({"epoch": epoch, "batches": batches, "keys": keys})
        if args.stop_after is not None and batches_seen == args.stop_after:
            break
    record = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "epochs": epochs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank-{record['rank']}.json").write_text(json.dumps(record))
    counts = torch.tensor([[e["batches"] for e in epochs]], device=accelerator.device)
    gathered = accelerator.gather(counts)
    accelerator.wait_for_everyone()
    equal = bool((gathered == gathered[0]).all())
    if accelerator.is_main_process:
        print("ok: equal batches on every rank" if equal else f"error: batches {gathered.tolist()}")
    accelerator.end_training()
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())

"""Save and restore the loader state of every rank with
``torch.distributed.checkpoint`` (DCP), as torchtitan does, and resume
mid-epoch exactly.

DCP writes one checkpoint for the whole job, and a key that several ranks
save is written once (from one rank): the loader state, which differs from
rank to rank, goes under a key of its own per rank,
``{"dataloader": {"rank0": bytes, "rank1": bytes, ...}}``, through a
``Stateful`` wrapper that DCP calls at save and at load. Each rank's value
is its ``StatefulDataLoader.state_dict()`` pickled (it holds the
``StreamingDataset`` state of each of its DataLoader workers). On load each
rank asks for its own key only. Model and optimizer state go beside it as
usual.

Run it with torchrun (CPU and the ``gloo`` backend are enough)::

    python examples/make_dataset.py /tmp/shards --shards 8 --samples-per-shard 16
    # stop after 5 batches per rank, with a checkpoint:
    torchrun --standalone --nproc_per_node 2 examples/dcp_resume.py \\
        '/tmp/shards/shard-{000000..000007}.tar' /tmp/ckpt /tmp/out-save --steps 5
    # a new job loads it and reads the rest of the epoch:
    torchrun --standalone --nproc_per_node 2 examples/dcp_resume.py \\
        '/tmp/shards/shard-{000000..000007}.tar' /tmp/ckpt /tmp/out-resume --resume

Each rank writes the sample keys it read to ``OUT_DIR/rank-{rank}.json``;
the keys of the first run followed by the second's are, on every rank, the
keys of one uninterrupted epoch (leave out ``--steps`` and ``--resume`` to
read one). Resume with the same data, ``--seed``, ``--batch-size``,
``--workers`` and number of ranks; with another number of ranks or workers,
``--elastic-from 2`` (the old job's ranks) loads every old rank's state
into the dataset instead, and the new ranks read each sample the old job
had not read once::

    torchrun --standalone --nproc_per_node 1 examples/dcp_resume.py \\
        '/tmp/shards/shard-{000000..000007}.tar' /tmp/ckpt /tmp/out-elastic --elastic-from 2

``--ledger DIR`` (in every run of a job) writes the sample ledger; the
checkpoint keeps its resume step, and ``shardstream verify DIR`` proves the
epoch exactly once across the runs, elastic ones included.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful
from torchdata.stateful_dataloader import StatefulDataLoader

from shardstream import Ledger, StreamingDataset, elastic_state

# How DataLoader workers start in a DDP rank: forked ones can hang as they
# start on CPython before 3.12 (gh-112275; docs/integrations.md), spawned
# ones cannot; from 3.12 on the default (fork) is safe.
WORKER_START = "spawn" if sys.version_info < (3, 12) else None


class LoaderState(Stateful):
    """What DCP saves of a rank's ``StatefulDataLoader``: its state pickled,
    under a key of this rank's own (DCP keeps one copy of a key that
    several ranks save)."""

    def __init__(self, loader: StatefulDataLoader, rank: int) -> None:
        self.loader = loader
        self.key = f"rank{rank}"

    def state_dict(self) -> dict[str, Any]:
        return {self.key: pickle.dumps(self.loader.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(pickle.loads(state_dict[self.key]))


class ElasticLoaderState(Stateful):
    """Loads the loader states of every rank of an earlier job of
    ``old_world_size`` ranks into the dataset, for a job of another number
    of ranks or DataLoader workers: the rest of the epoch comes once,
    split anew (``shardstream.elastic_state``)."""

    def __init__(self, dataset: StreamingDataset, old_world_size: int) -> None:
        self.dataset = dataset
        self.keys = [f"rank{r}" for r in range(old_world_size)]

    def state_dict(self) -> dict[str, Any]:
        # Placeholders: DCP replaces each with the saved value.
        return {key: b"" for key in self.keys}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = [pickle.loads(state_dict[key]) for key in self.keys]
        self.dataset.load_state_dict(elastic_state(*states))


class LedgerStep(Stateful):
    """The step a run resumed from the checkpoint records first in the
    sample ledger (the same on every rank, so one key serves them all).
    Saving makes the ledger's records durable."""

    def __init__(self) -> None:
        self.ledger: Ledger | None = None
        self.resume_step = 0

    def state_dict(self) -> dict[str, Any]:
        step = self.ledger.checkpoint() if self.ledger is not None else self.resume_step
        return {"resume_step": str(step).encode()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.resume_step = int(state_dict["resume_step"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Checkpoint the loader of every rank with torch.distributed.checkpoint."
    )
    parser.add_argument("data_spec", help="dataset spec: path, brace range (quote it), URL")
    parser.add_argument("checkpoint", type=Path, help="the DCP checkpoint directory")
    parser.add_argument("out_dir", type=Path, help="where to write rank-{rank}.json")
    parser.add_argument(
        "--steps", type=int, default=None, help="save after this many batches and stop"
    )
    parser.add_argument("--resume", action="store_true", help="load the checkpoint first")
    parser.add_argument(
        "--elastic-from",
        type=int,
        default=None,
        metavar="N",
        help="load the checkpoint of a job of N ranks (any number of ranks and workers now)",
    )
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per batch")
    parser.add_argument("--seed", type=int, default=0, help="dataset seed")
    parser.add_argument("--ledger", type=Path, help="write the sample ledger there")
    return parser.parse_args(argv)


def keys_only(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``collate_fn`` keeping the sample keys (a training loop would
    collate tensors), and their ids for the ledger when they carry them."""
    batch: dict[str, Any] = {"keys": [s["__key__"] for s in samples]}
    if "__id__" in samples[0]:  # sample_ids=True
        batch["__id__"] = torch.tensor([s["__id__"] for s in samples])
    return batch


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    # rank and world size come from torch.distributed.
    dataset = StreamingDataset(
        args.data_spec, seed=args.seed, shuffle_buffer=16, sample_ids=args.ledger is not None
    )
    loader = StatefulDataLoader(
        dataset,
        batch_size=args.batch_size,
        num_workers=args.workers,
        collate_fn=keys_only,
        timeout=120 if args.workers else 0,
        multiprocessing_context=WORKER_START if args.workers else None,
        # Spawned workers start once, not at every epoch (each imports
        # torch anew); epochs advance in them by themselves.
        persistent_workers=args.workers > 0,
    )
    state: dict[str, Any] = {"model": model.state_dict(), "dataloader": LoaderState(loader, rank)}
    ledger_step = LedgerStep()
    if args.ledger is not None:
        state["ledger"] = ledger_step
    if args.resume:
        # Fills state["model"] in place and calls LoaderState.load_state_dict.
        dcp.load(state, checkpoint_id=str(args.checkpoint))
        model.load_state_dict(state["model"])
    elif args.elastic_from is not None:
        elastic = {
            "model": state["model"],
            "dataloader": ElasticLoaderState(dataset, args.elastic_from),
            **({"ledger": ledger_step} if args.ledger is not None else {}),
        }
        dcp.load(elastic, checkpoint_id=str(args.checkpoint))
        model.load_state_dict(state["model"])
    batches: Any = loader
    if args.ledger is not None:
        # A new generation from the loaded step (a collective: every rank).
        workers = max(args.workers, 1)
        ledger_step.ledger = Ledger(
            args.ledger, dataset, resume_step=ledger_step.resume_step, num_workers=workers
        )
        batches = ledger_step.ledger.track(loader)
    keys: list[str] = []
    for step, batch in enumerate(batches, start=1):
        keys += batch["keys"]  # a training step would go here
        if args.steps is not None and step == args.steps:
            dcp.save(state, checkpoint_id=str(args.checkpoint))
            break
    if ledger_step.ledger is not None:
        ledger_step.ledger.close()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "world_size": dist.get_world_size(), "keys": keys}
    (args.out_dir / f"rank-{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

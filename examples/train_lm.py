"""Train a tiny GPT on text shards tokenized and packed by shardstream,
stop mid-epoch with a checkpoint, and resume exactly.

The loader: JSON-lines shards, ``shardstream.Tokenizer`` on the decode
threads, ``pack=Pack(seq_len, mode="best_fit", labels=True)`` and Rust
batches, in a ``StatefulDataLoader``; each batch is ``input_ids``,
``labels`` (``-100`` before padding) and ``position_ids`` (restarting at
each document), from which the model builds a causal mask that keeps each
document to itself (on a GPU, ``cu_seqlens`` feeds a variable-length
attention kernel instead). The checkpoint holds the model, the optimizer,
the step and the loader's state (a few numbers per held document piece, not
the tokens)::

    # one uninterrupted epoch:
    python examples/train_lm.py 'c/part-{0..2}.jsonl' tok.json /tmp/ckpt /tmp/out-whole
    # stop after 4 steps with a checkpoint, then resume from it:
    python examples/train_lm.py 'c/part-{0..2}.jsonl' tok.json /tmp/ckpt /tmp/out-a --steps 4
    python examples/train_lm.py 'c/part-{0..2}.jsonl' tok.json /tmp/ckpt /tmp/out-b --resume

Each run writes ``OUT_DIR/steps.jsonl`` (step, loss, a checksum of the
batch's tokens): the first run's lines followed by the resumed run's are the
uninterrupted run's, losses included.

Under ``torchrun`` each rank trains on its own part of the documents (DDP over
gloo or NCCL) and every rank takes the same number of steps: the sequences
are planned from the token counts that ``shardstream index`` records in the
manifest beside the shards (docs/text.md)::

    shardstream index 'c/part-{0..2}.jsonl' -o c/manifest.json --format jsonl \
        --count-tokens text --tokenizer tok.json --eos '</s>'
    torchrun --nproc_per_node 2 examples/train_lm.py 'c/part-{0..2}.jsonl' tok.json \
        /tmp/ckpt.pt /tmp/out --ledger /tmp/ledger
    shardstream verify /tmp/ledger

Each rank then writes ``steps-rank<R>.jsonl`` and its own checkpoint
(``ckpt-rank<R>.pt``); ``--ledger`` records which documents each step
trained on, for ``shardstream verify``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchdata.stateful_dataloader import StatefulDataLoader

from shardstream import Ledger, Pack, StreamingDataset, Tokenizer


class TinyGPT(nn.Module):
    """Token and position embeddings, pre-norm attention blocks, tied output."""

    def __init__(
        self, vocab: int, dim: int = 32, layers: int = 2, heads: int = 2, max_len: int = 512
    ):
        super().__init__()
        self.heads = heads
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm1": nn.LayerNorm(dim),
                    "qkv": nn.Linear(dim, 3 * dim),
                    "out": nn.Linear(dim, dim),
                    "norm2": nn.LayerNorm(dim),
                    "mlp": nn.Sequential(
                        nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
                    ),
                }
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        batch, length = ids.shape
        # Document masking: position 0 starts a document; a token sees the
        # tokens of its own document up to itself.
        document = torch.cumsum(positions == 0, dim=1)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        mask = (document[:, :, None] == document[:, None, :]) & causal
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            q, k, v = block["qkv"](block["norm1"](x)).chunk(3, dim=-1)
            q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
            x = x + block["out"](attended.transpose(1, 2).reshape(batch, length, -1))
            x = x + block["mlp"](block["norm2"](x))
        return self.norm(x) @ self.tokens.weight.T


def loader_for(args: argparse.Namespace) -> StatefulDataLoader:
    dataset = StreamingDataset(
        args.urls,
        seed=args.seed,
        shuffle_buffer=64,
        decode={"text": Tokenizer(args.tokenizer, eos=args.eos)},
        pack=Pack(args.seq_len, mode="best_fit", labels=True),
        batch_size=args.batch_size,
        sample_ids=args.ledger is not None,
    )
    return StatefulDataLoader(dataset, batch_size=None, num_workers=args.workers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("urls", help="the text shards (JSON lines with a 'text' field)")
    parser.add_argument("tokenizer", help="a tokenizer.json")
    parser.add_argument("checkpoint", type=Path, help="the checkpoint file written or read")
    parser.add_argument("out", type=Path, help="where steps.jsonl goes")
    parser.add_argument("--steps", type=int, help="stop after this many steps, with a checkpoint")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eos", default="</s>")
    parser.add_argument("--ledger", type=Path, help="record each step's documents here")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    # Under torchrun each rank keeps its own checkpoint and step log.
    suffix = f"-rank{rank}" if world > 1 else ""
    checkpoint = args.checkpoint.with_name(args.checkpoint.stem + suffix + args.checkpoint.suffix)

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the same sums in the same order: losses repeat exactly
    vocab = Tokenizer(args.tokenizer).vocab_size
    net = TinyGPT(vocab, max_len=args.seq_len + 1)
    model = DistributedDataParallel(net) if world > 1 else net
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = loader_for(args)
    step = 0
    if args.resume:
        saved: dict[str, Any] = torch.load(checkpoint, weights_only=False)
        net.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["loader"])
        step = saved["step"]
    ledger = None
    if args.ledger is not None:
        ledger = Ledger(args.ledger, loader.dataset, resume_step=step if args.resume else None)
    args.out.mkdir(parents=True, exist_ok=True)
    # The ledger records each batch as a step, and the epoch's end.
    batches = loader if ledger is None else ledger.track(loader)
    with open(args.out / f"steps{suffix}.jsonl", "w") as log:
        for batch in batches:
            ids = torch.as_tensor(batch["input_ids"]).long()
            labels = torch.as_tensor(batch["labels"]).long()
            positions = torch.as_tensor(batch["position_ids"]).long()
            logits = model(ids, positions)
            loss = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), ignore_index=-100)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            record = {"step": step, "loss": loss.item(), "checksum": int(ids.sum())}
            log.write(json.dumps(record) + "\n")
            if args.steps is not None and step == args.steps:
                if ledger is not None:
                    ledger.checkpoint()
                state = {
                    "model": net.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "loader": loader.state_dict(),
                    "step": step,
                }
                torch.save(state, checkpoint)
                break
    if ledger is not None:
        ledger.close()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

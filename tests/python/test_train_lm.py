"""``examples/train_lm.py``: a tiny GPT on packed sequences, stopped with a
checkpoint and resumed: the batches and the losses of the two runs are the
uninterrupted run's."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

from _shardtest import EXAMPLES_DIR, run_bounded
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import models, pre_tokenizers, trainers

RUN_TIMEOUT = 240


def corpus(root: Path) -> tuple[str, str]:
    """Three JSON-lines shards of generated text and a BPE trained on them."""
    rng = random.Random(7)
    words = [f"w{i}" for i in range(300)]
    texts = []
    root.mkdir(parents=True)
    for shard in range(3):
        lines = []
        for _ in range(30):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 90)))
            texts.append(text)
            lines.append(json.dumps({"text": text}))
        (root / f"part-{shard}.jsonl").write_text("\n".join(lines) + "\n")
    tokenizer = HfTokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]", "</s>"])
    tokenizer.train_from_iterator(texts, trainer)
    path = root / "tokenizer.json"
    tokenizer.save(str(path))
    return str(root / "part-{0..2}.jsonl"), str(path)


def train(tmp_path: Path, spec: str, tokenizer: str, out: str, *extra: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, str(EXAMPLES_DIR / "train_lm.py"), spec, tokenizer]
    command += [str(tmp_path / "ckpt.pt"), str(tmp_path / out), *extra]
    proc = run_bounded(command, cwd=tmp_path, env=env, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-5000:]}"
    lines = (tmp_path / out / "steps.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_a_run_stopped_and_resumed_trains_on_the_uninterrupted_runs_batches(tmp_path: Path) -> None:
    spec, tokenizer = corpus(tmp_path / "corpus")
    whole = train(tmp_path, spec, tokenizer, "whole")
    assert len(whole) > 8
    first = train(tmp_path, spec, tokenizer, "first", "--steps", "5")
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5]
    rest = train(tmp_path, spec, tokenizer, "rest", "--resume")
    assert [(r["step"], r["checksum"]) for r in first + rest] == [
        (r["step"], r["checksum"]) for r in whole
    ]
    # The model and optimizer came back too: the losses repeat.
    for got, want in zip(first + rest, whole, strict=True):
        assert abs(got["loss"] - want["loss"]) < 1e-5, (got, want)
    # The loss falls: the masks and labels line up with the tokens.
    assert whole[-1]["loss"] < whole[0]["loss"]


def train_ranks(
    tmp_path: Path, spec: str, tokenizer: str, out: str, *extra: str
) -> list[list[dict]]:
    """``train_lm.py`` under torchrun, 2 ranks (gloo): each rank's steps."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += [str(EXAMPLES_DIR / "train_lm.py"), spec, tokenizer]
    command += [str(tmp_path / "ckpt.pt"), str(tmp_path / out), *extra]
    proc = run_bounded(command, cwd=tmp_path, env=env, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-5000:]}"
    return [
        [
            json.loads(line)
            for line in (tmp_path / out / f"steps-rank{r}.jsonl").read_text().splitlines()
        ]
        for r in range(2)
    ]


def test_two_ranks_under_torchrun_take_equal_steps_and_resume_exactly(tmp_path: Path) -> None:
    spec, tokenizer = corpus(tmp_path / "corpus")
    manifest = tmp_path / "corpus" / "manifest.json"
    index = [sys.executable, "-m", "shardstream", "index", spec, "-o", str(manifest)]
    index += [
        "--format",
        "jsonl",
        "--count-tokens",
        "text",
        "--tokenizer",
        tokenizer,
        "--eos",
        "</s>",
    ]
    done = run_bounded(index, cwd=tmp_path, env=dict(os.environ), timeout=RUN_TIMEOUT)
    assert done.returncode == 0, done.stderr
    whole = train_ranks(tmp_path, spec, tokenizer, "whole")
    # Every rank took as many steps (DDP would have waited otherwise).
    assert len(whole[0]) == len(whole[1]) > 4, [len(w) for w in whole]
    ledger = str(tmp_path / "ledger")
    first = train_ranks(tmp_path, spec, tokenizer, "first", "--steps", "3", "--ledger", ledger)
    rest = train_ranks(tmp_path, spec, tokenizer, "rest", "--resume", "--ledger", ledger)
    for r in range(2):
        assert [(s["step"], s["checksum"]) for s in first[r] + rest[r]] == [
            (s["step"], s["checksum"]) for s in whole[r]
        ]
        for got, want in zip(first[r] + rest[r], whole[r], strict=True):
            assert abs(got["loss"] - want["loss"]) < 1e-5, (r, got, want)
    # The ledger of the stopped and resumed run: no document twice.
    verify = [sys.executable, "-m", "shardstream", "verify", ledger, "--json"]
    done = run_bounded(verify, cwd=tmp_path, env=dict(os.environ), timeout=RUN_TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    epoch = json.loads(done.stdout)["epochs"][0]
    assert epoch["complete"] and epoch["violation"] is None, epoch
    assert epoch["distinct"] + epoch["packed_left_out"] == epoch["expected"] == 90, epoch

"""Tokenizer benchmark behind `make bench`: tokens/s of one thread turning
documents into ids, ``shardstream.Tokenizer.encode`` against the Python
``tokenizers`` package's ``Tokenizer.encode`` (the same ``tokenizer.json``,
one document a call, ids checked equal for every document), on two texts:

- the text benchmark's corpus (its first ``.jsonl.zst`` shard and its
  byte-level BPE of 16,000 tokens; made by ``text_bench.py`` if absent);
- real text: the ``.py``, ``.md``, ``.rst`` and ``.txt`` files of the
  installed Python packages (code, docstrings and documentation, in a fixed
  order), a byte-level BPE of 32,000 tokens trained on 20 MB of them and
  timed on another 20 MB, so that words the tokenizer never saw come often.

    python benches/tokenizer_bench.py --out bench-results [--mb 20] [--repeats 3]

Best of ``--repeats`` passes each; the first pass of shardstream's fills its
per-thread word cache, as the first shard of an epoch does.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from text_bench import EOS, make_corpus  # noqa: E402


def corpus_documents(out: Path) -> tuple[list[str], Path]:
    """The text benchmark corpus's first shard's documents and its tokenizer."""
    import zstandard

    jsonl, _, tokenizer = make_corpus(out / "text-data-200mb", 200, 8)
    with jsonl[0].open("rb") as f:
        data = zstandard.ZstdDecompressor().stream_reader(f).read().decode()
    return [json.loads(line)["text"] for line in data.splitlines() if line.strip()], tokenizer


def real_documents(out: Path, megabytes: int) -> tuple[list[str], Path]:
    """Files of the installed packages as documents: ``megabytes`` of them
    to time, and a byte-level BPE trained on as many others."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    root = Path(sysconfig.get_paths()["purelib"])
    files = sorted(p for ext in ("py", "md", "rst", "txt") for p in root.rglob(f"*.{ext}"))
    random.Random(0).shuffle(files)
    docs: list[str] = []
    total = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip() and EOS not in text:
            docs.append(text)
            total += len(text)
        if total > 2 * megabytes * 1_000_000:
            break
    half = len(docs) // 2
    path = out / "tokenizer-bench-real.json"
    if not path.exists():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=32_000,
            special_tokens=[EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(docs[:half], trainer)
        tok.save(str(path))
    return docs[half:], path


def best_rate(encode, docs: list[str], repeats: int) -> tuple[float, int]:
    """Tokens/s of the best of ``repeats`` passes, and the tokens of one."""
    best, tokens = 0.0, 0
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = sum(len(encode(d)) for d in docs)
        best = max(best, tokens / (time.perf_counter() - start))
    return best, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--mb", type=int, default=20, help="MB of real text timed")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from tokenizers import Tokenizer as PyTokenizer

    from shardstream import Tokenizer

    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, (docs, path) in (
        ("text benchmark corpus, 1 shard", corpus_documents(args.out)),
        ("installed packages' files", real_documents(args.out, args.mb)),
    ):
        ours = Tokenizer(str(path))
        theirs = PyTokenizer.from_file(str(path))
        for doc in docs:
            assert ours.encode(doc).tolist() == theirs.encode(doc).ids, "ids differ"
        mine, tokens = best_rate(ours.encode, docs, args.repeats)
        library, _ = best_rate(lambda d, t=theirs: t.encode(d).ids, docs, args.repeats)
        rows.append(
            {
                "text": name,
                "documents": len(docs),
                "tokens": tokens,
                "shardstream_tokens_per_s": mine,
                "tokenizers_tokens_per_s": library,
            }
        )
    (args.out / "tokenizer_bench.json").write_text(json.dumps(rows, indent=2))
    print(
        "| text | documents | tokens | shardstream `Tokenizer.encode` "
        "| `tokenizers` `encode` | ratio |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['text']} | {r['documents']:,} | {r['tokens']:,} | "
            f"{r['shardstream_tokens_per_s']:,.0f} tokens/s | "
            f"{r['tokenizers_tokens_per_s']:,.0f} tokens/s | "
            f"{r['shardstream_tokens_per_s'] / r['tokenizers_tokens_per_s']:.2f}x |"
        )
    print(f"(one thread, best of {args.repeats}; ids equal for every document)")


if __name__ == "__main__":
    main()

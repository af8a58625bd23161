"""Text benchmark behind `make bench`: tokens/s and CPU per token of one
epoch of tokenized documents, by shardstream (JSON lines zstd and Parquet
shards, ``shardstream.Tokenizer`` on the decode threads) and by Hugging Face
``datasets`` streaming the same JSON lines with the Python ``tokenizers``
package (``encode_batch_fast`` in ``.map(batched=True)``), in DataLoader
workers, at the same worker count; and LitData's ``TokensLoader`` reading
the corpus tokenized and converted beforehand (``litdata.optimize``, the
same tokenizer, its time reported apart), in blocks of ``seq_len + 1``.

    python benches/text_bench.py --out bench-results [--mb 200] [--repeats 3] [--workers 2]

The corpus: generated English-like text (a Zipf draw over 5,000 words,
punctuation and line breaks), documents of 200 to 20,000 tokens
(log-uniform), written once as ``.jsonl.zst`` shards and as Parquet files
(row groups of 256 documents); the tokenizer is a byte-level BPE of 16,000
tokens trained on 4 MB of the corpus, with ``<|endoftext|>`` after each
document. Every reader hands out each document's ids; the consumer sums
them (touching every token); the packed readers (``pack=Pack(2048,
mode=...)``, Rust batches of 8 sequences) hand out sequences, whose real
tokens (not padding) are counted, summed and checked to be the documents'
(every token once), with the padding fraction; items cross from the workers as they are
(no conversion to tensors). Each run is a fresh subprocess; CPU seconds
are user + system time of the epoch in the main process and its workers
(imports left out). Runs are interleaved and medians reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from decode_bench import cpu_seconds, measure  # noqa: E402
from loader_bench import warm  # noqa: E402

READERS = (
    "shardstream-jsonl.zst",
    "shardstream-parquet",
    "shardstream-jsonl.zst+pack-concat",
    "shardstream-jsonl.zst+pack-best_fit",
    "litdata-tokens (converted beforehand)",
    "hf-datasets+tokenizers",
)
LITDATA = "litdata-tokens"
SEQ_LEN = 2048
PACK_BATCH = 8
PAD = -1
EOS = "<|endoftext|>"
WORDS_PER_TOKEN = 0.75


def vocabulary(count: int, rng: random.Random) -> list[str]:
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    weights = [26 - i for i in range(26)]
    return ["".join(rng.choices(letters, weights, k=rng.randint(1, 10))) for _ in range(count)]


def documents(rng: random.Random, total_bytes: int):
    """Documents of 200-20,000 tokens (log-uniform) until `total_bytes`."""
    words = vocabulary(5000, rng)
    weights = [1 / (rank + 1) for rank in range(len(words))]
    written = 0
    while written < total_bytes:
        tokens = math.exp(rng.uniform(math.log(200), math.log(20000)))
        count = max(1, int(tokens * WORDS_PER_TOKEN))
        chosen = rng.choices(words, weights, k=count)
        for at in range(12, count, 13):
            chosen[at] += rng.choice((".", ",", ".\n", "?"))
        text = " ".join(chosen)
        written += len(text)
        yield text


def make_corpus(root: Path, megabytes: int, shards: int) -> tuple[list[Path], list[Path], Path]:
    """The corpus as JSON-lines zstd shards and Parquet files, and the
    tokenizer's file; kept when already there."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root.mkdir(parents=True, exist_ok=True)
    jsonl = [root / f"docs-{i:03d}.jsonl.zst" for i in range(shards)]
    parquet = [root / f"docs-{i:03d}.parquet" for i in range(shards)]
    tokenizer = root / "tokenizer.json"
    if all(p.exists() for p in [*jsonl, *parquet, tokenizer]):
        return jsonl, parquet, tokenizer
    docs = list(documents(random.Random(0), megabytes << 20))
    per_shard = -(-len(docs) // shards)
    for i in range(shards):
        part = docs[i * per_shard : (i + 1) * per_shard]
        lines = "".join(
            json.dumps({"text": t, "id": i * per_shard + j}) + "\n" for j, t in enumerate(part)
        )
        jsonl[i].write_bytes(zstandard.ZstdCompressor(level=3).compress(lines.encode()))
        table = pa.table(
            {"text": part, "id": list(range(i * per_shard, i * per_shard + len(part)))}
        )
        pq.write_table(table, parquet[i], row_group_size=256, compression="zstd")
    train_tokenizer(docs, tokenizer)
    return jsonl, parquet, tokenizer


def train_tokenizer(docs: list[str], path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=16000,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sample, size = [], 0
    for doc in docs:
        sample.append(doc)
        size += len(doc)
        if size > 4 << 20:
            break
    tok.train_from_iterator(sample, trainer=trainer)
    tok.save(str(path))


def tokenized_lines(path: str):
    """``litdata.optimize``'s function: each document of a ``.jsonl.zst``
    shard as its int32 ids with ``EOS`` after them (what the other readers
    give), by the Python ``tokenizers`` package."""
    import io

    import torch
    import zstandard
    from tokenizers import Tokenizer as PyTokenizer

    tok = PyTokenizer.from_file(str(Path(path).parent / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    with open(path, "rb") as raw:
        text = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw), encoding="utf-8")
        for line in text:
            ids = tok.encode(json.loads(line)["text"]).ids
            yield torch.tensor([*ids, eos], dtype=torch.int32)


def convert_for_litdata(root: Path, workers: int) -> float:
    """The corpus converted into LitData's token chunks under
    ``root/litdata-tokens`` (kept when there); the seconds it took."""
    out = root / LITDATA
    timing = root / f"{LITDATA}.json"
    if timing.exists():
        return json.loads(timing.read_text())["seconds"]
    import shutil

    from litdata import TokensLoader, optimize

    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    optimize(
        fn=tokenized_lines,
        inputs=sorted(str(p) for p in root.glob("*.jsonl.zst")),
        output_dir=str(out),
        chunk_size=(SEQ_LEN + 1) * 1024,
        item_loader=TokensLoader(),
        num_workers=workers,
    )
    seconds = time.perf_counter() - start
    timing.write_text(json.dumps({"seconds": seconds}))
    return seconds


def as_is(item):
    """The DataLoader's per-item hook for both readers: items as they are
    (its default turns each document's ids into a tensor moved to shared
    memory, which costs more than tokenizing short documents)."""
    return item


def run_epoch(spec: str, reader: str, num_workers: int) -> dict[str, float]:
    """One epoch in this process; returns the measurements."""
    from torch.utils.data import DataLoader

    root = Path(spec)
    tokenizer_path = root / "tokenizer.json"
    packed = "+pack-" in reader or reader.startswith(LITDATA)
    if reader.startswith(LITDATA):
        from litdata import StreamingDataLoader, TokensLoader
        from litdata import StreamingDataset as LitDataset

        blocks = LitDataset(
            str(root / LITDATA), item_loader=TokensLoader(block_size=SEQ_LEN + 1), shuffle=False
        )
        loader = StreamingDataLoader(blocks, batch_size=PACK_BATCH, num_workers=num_workers)
    elif reader.startswith("shardstream"):
        from shardstream import Pack, StreamingDataset, Tokenizer

        pattern = "*.jsonl.zst" if "jsonl.zst" in reader else "*.parquet"
        urls = sorted(str(p) for p in root.glob(pattern))
        options = {}
        if packed:
            mode = reader.split("+pack-")[1]
            options = {"pack": Pack(SEQ_LEN, mode=mode, pad_id=PAD), "batch_size": PACK_BATCH}
        dataset = StreamingDataset(
            urls,
            seed=0,
            shuffle_buffer=0,
            decode={"text": Tokenizer(tokenizer_path, eos=EOS)},
            **options,
        )
        loader = DataLoader(dataset, batch_size=None, num_workers=num_workers, collate_fn=as_is)
        documents_of = lambda item: (item["text"],)  # noqa: E731
    else:
        from datasets import load_dataset
        from tokenizers import Tokenizer as PyTokenizer

        tok = PyTokenizer.from_file(str(tokenizer_path))
        eos = tok.token_to_id(EOS)
        files = sorted(str(p) for p in root.glob("*.jsonl.zst"))
        stream = load_dataset("json", data_files=files, split="train", streaming=True)

        def tokenize(batch: dict) -> dict:
            return {"ids": [[*e.ids, eos] for e in tok.encode_batch_fast(batch["text"])]}

        stream = stream.map(tokenize, batched=True, remove_columns=["text"])
        loader = DataLoader(stream, batch_size=None, num_workers=num_workers, collate_fn=as_is)
        documents_of = lambda item: (item["ids"],)  # noqa: E731
    start_cpu, start = cpu_seconds(), time.perf_counter()
    docs = tokens = checksum = slots = 0
    if packed:
        # Sequences: the real tokens are those that are not padding (no
        # token id is PAD); documents are not counted.
        for item in loader:
            ids = item if reader.startswith(LITDATA) else item["input_ids"]
            real = ids[ids != PAD]
            slots += ids.numel() if reader.startswith(LITDATA) else ids.size
            tokens += int(real.numel() if reader.startswith(LITDATA) else real.size)
            checksum += int(real.sum())
    else:
        for item in loader:
            for ids in documents_of(item):
                docs += 1
                tokens += len(ids)
                checksum += int(sum(ids)) if isinstance(ids, list) else int(ids.sum())
    elapsed = time.perf_counter() - start
    return {
        "documents": docs,
        "tokens": tokens,
        "checksum": checksum,
        "slots": slots,
        "seconds": elapsed,
        "cpu_seconds": cpu_seconds() - start_cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--mb", type=int, default=200, help="corpus size (MB of text)")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--child", nargs=3, metavar=("SPEC", "READER", "WORKERS"))
    args = parser.parse_args()
    if args.child:
        spec, reader, workers = args.child
        print(json.dumps(run_epoch(spec, reader, int(workers))))
        return

    root = args.out / f"text-data-{args.mb}mb"
    jsonl, parquet, _ = make_corpus(root, args.mb, args.shards)
    conversion = convert_for_litdata(root, args.workers)
    warm([*jsonl, *parquet, *(root / LITDATA).glob("*")])
    runs: dict[str, list[dict[str, float]]] = {r: [] for r in READERS}
    for _ in range(args.repeats):
        for reader in READERS:
            runs[reader].append(measure(str(root), reader, args.workers, __file__))
    first = runs[READERS[0]][0]
    for reader, result in runs.items():
        for run in result:
            if reader.startswith(LITDATA):
                # Blocks of seq_len + 1 tokens: a chunk's tail that fills
                # no block is not handed out.
                assert 0.99 * first["tokens"] <= run["tokens"] <= first["tokens"], run
                continue
            # Every reader gives the same ids (packed: every token once).
            assert (run["tokens"], run["checksum"]) == (first["tokens"], first["checksum"]), (
                reader,
                run,
            )
            assert "+pack-" in reader or run["documents"] == first["documents"], (reader, run)
    rows = []
    for reader in READERS:
        result = runs[reader]
        rows.append(
            {
                "reader": reader,
                "num_workers": args.workers,
                "documents": first["documents"],
                "tokens": first["tokens"],
                "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in result),
                "tokens_per_cpu_s": statistics.median(
                    r["tokens"] / r["cpu_seconds"] for r in result
                ),
                "padding": 1 - result[0]["tokens"] / result[0]["slots"]
                if result[0]["slots"]
                else None,
            }
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "text_bench.json").write_text(json.dumps(rows, indent=2))
    base = rows[-1]
    print("| reader | num_workers | tokens/s | vs HF | tokens per CPU-second | vs HF | padding |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        padding = "-" if row["padding"] is None else f"{100 * row['padding']:.2f}%"
        print(
            f"| {row['reader']} | {row['num_workers']} | {row['tokens_per_s']:,.0f} | "
            f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
            f"{row['tokens_per_cpu_s']:,.0f} | "
            f"{row['tokens_per_cpu_s'] / base['tokens_per_cpu_s']:.2f}x | {padding} |"
        )
    print(
        f"({os.cpu_count()} cores, {first['documents']:,} documents, {first['tokens']:,} tokens, "
        f"{args.repeats} runs each, medians; LitData's conversion took {conversion:.1f} s "
        f"with {args.workers} workers, apart from its reads)"
    )


if __name__ == "__main__":
    main()

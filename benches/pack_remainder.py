"""What packing across ranks leaves out: the text benchmark's corpus
(``text_bench.make_corpus``), indexed with its token counts, packed
(``Pack(2048)``, concat) by every slot of each layout, streamed for real;
the sequences each rank hands out and the share of the corpus's tokens no
sequence holds. For comparison, the share a cut into equal numbers of
documents would leave out (each slot's tokens summed over
``shardstream plan``'s runs, the same rule of the least over the ranks).

    python benches/pack_remainder.py --out bench-results [--layouts 2x2,8x4,32x8]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from text_bench import EOS, SEQ_LEN, make_corpus  # noqa: E402

CAPACITY = SEQ_LEN + 1


def index(spec: str, manifest: Path, tokenizer: Path) -> None:
    if not manifest.exists():
        argv = ["shardstream", "index", spec, "-o", str(manifest), "--format", "jsonl"]
        argv += ["--count-tokens", "text", "--tokenizer", str(tokenizer), "--eos", EOS]
        subprocess.run(argv, check=True)


def streamed(spec: str, tokenizer: Path, world: int, workers: int) -> tuple[list[int], int]:
    """Each rank's sequences and the real tokens of all, every slot packed."""
    from shardstream import Pack, StreamingDataset, Tokenizer

    tok = Tokenizer(str(tokenizer), eos=EOS)
    per_rank, real = [0] * world, 0
    for rank in range(world):
        for worker in range(workers):
            ds = StreamingDataset(
                spec,
                decode={"text": tok},
                pack=Pack(SEQ_LEN, pad_id=-1),
                world_size=world,
                rank=rank,
                num_workers=workers,
                worker_id=worker,
                batch_size=8,
            )
            for batch in ds:
                ids = batch["input_ids"]
                per_rank[rank] += ids.shape[0]
                real += int((ids != -1).sum())
    return per_rank, real


def by_documents(spec: str, counts: dict[str, list[int]], world: int, workers: int) -> int:
    """Tokens handed out if the plan cut equal documents per slot."""
    argv = ["shardstream", "plan", spec, "--format", "jsonl"]
    argv += ["--world-size", str(world), "--workers", str(workers)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    slots: dict[tuple[int, int], int] = {}
    current = (0, 0)
    for line in out.splitlines():
        if m := re.match(r"rank (\d+) worker (\d+):", line):
            current = (int(m[1]), int(m[2]))
            slots[current] = 0
        elif m := re.match(r"\s+(\S+) samples (\d+)\.\.(\d+)", line):
            slots[current] += sum(counts[Path(m[1]).name][int(m[2]) : int(m[3])])
    handed = 0
    for worker in range(workers):
        planned = min(-(-slots[(r, worker)] // CAPACITY) for r in range(world))
        handed += sum(min(planned * CAPACITY, slots[(r, worker)]) for r in range(world))
    return handed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--layouts", default="2x2,8x4", help="ranks x workers, comma-separated")
    args = parser.parse_args()
    root = args.out / "text-data-200mb"  # text_bench.py's corpus, shared
    _, _, tokenizer = make_corpus(root, 200, 8)
    spec = str(root / "docs-{000..007}.jsonl.zst")
    index(spec, root / "manifest.json", tokenizer)
    entries = json.loads((root / "manifest.json").read_text())["shards"]
    counts = {Path(e["url"]).name: e["tokens"]["counts"] for e in entries}
    total = sum(map(sum, counts.values()))
    documents = sum(map(len, counts.values()))
    print(f"{total:,} tokens in {documents:,} documents, seq_len {SEQ_LEN}, concat")
    print("| ranks x workers | sequences per rank | left out | cut by documents: left out | s |")
    print("|---|---|---|---|---|")
    for layout in args.layouts.split(","):
        world, workers = map(int, layout.split("x"))
        start = time.perf_counter()
        per_rank, real = streamed(spec, tokenizer, world, workers)
        took = time.perf_counter() - start
        assert len(set(per_rank)) == 1, per_rank
        docs_cut = 1 - by_documents(spec, counts, world, workers) / total
        print(
            f"| {world} x {workers} | {per_rank[0]:,} | {1 - real / total:.2%} | {docs_cut:.2%} "
            f"| {took:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

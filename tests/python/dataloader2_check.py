"""Streams a dataset through torchdata 0.9's ``DataLoader2`` with
``shardstream.datapipes.StreamingPipe`` for two epochs and writes, per rank,
``(worker pid, key)`` of every sample as JSON.

    python dataloader2_check.py SPEC OUT_DIR --workers 2            # one process
    torchrun --nproc_per_node 2 dataloader2_check.py SPEC OUT_DIR --workers 2 --distributed
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

SEED, SHUFFLE = 3, 5


def tag(sample):
    """Which worker process produced the sample."""
    return os.getpid(), sample["__key__"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("out", type=Path)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--distributed", action="store_true")
    args = parser.parse_args()
    # torchdata 0.9 warns that DataLoader2 is deprecated, once per import.
    warnings.filterwarnings("ignore", message=".*deprecated", category=UserWarning)
    import torch.distributed as dist
    import torchdata
    from torchdata.dataloader2 import (
        DataLoader2,
        DistributedReadingService,
        MultiProcessingReadingService,
        SequentialReadingService,
    )

    from shardstream import StreamingDataset
    from shardstream.datapipes import StreamingPipe

    service = MultiProcessingReadingService(num_workers=args.workers)
    rank = 0
    if args.distributed:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        service = SequentialReadingService(DistributedReadingService(), service)
    pipe = StreamingPipe(StreamingDataset(args.spec, seed=SEED, shuffle_buffer=SHUFFLE)).map(tag)
    loader = DataLoader2(pipe, reading_service=service)
    epochs = [list(loader) for _ in range(2)]
    loader.shutdown()
    result = {"torchdata": torchdata.__version__, "rank": rank, "epochs": epochs}
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

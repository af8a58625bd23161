"""Where the batched GPU decode spends its time: each stage of
`shardstream.gpu.BatchImageDecoder` on one batch of the train benchmark's
JPEGs, then a training step on a batch already on the device, alone and
beside a thread that decodes over and over (what the decode costs the step
when the batches do not come through a DataLoader).

    python benches/gpu_decode_profile.py --data DIR [--batch 256] [--steps 30]
        [--models resnet18 resnet50] [--device cuda]

DIR holds the shards under DIR/tar (`train_bench.py --data DIR` makes them;
so does this script when there are none). `--device cpu` makes a smoke run
(tests/python/test_train_bench.py): CPU figures, not GPU ones.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from augment_bench import make_dataset

SIZE = 224


def timed(name: str, fn: Callable[[], Any], sync: Callable[[], None], reps: int) -> None:
    """Prints the median and least wall time of `fn` (synchronised)."""
    fn()
    sync()
    walls = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        sync()
        walls.append(time.perf_counter() - began)
    print(
        f"{name}: {1000 * statistics.median(walls):.2f} ms per batch "
        f"(least {1000 * min(walls):.2f})",
        flush=True,
    )


def step_with(
    model_name: str, work: Callable[[], Any] | None, device: Any, batch: int, steps: int
) -> None:
    """Prints the time of a training step on a batch already on `device`,
    with `work` run over and over by a thread (on a stream of its own)."""
    import torch
    import torchvision

    model = getattr(torchvision.models, model_name)(num_classes=1000)
    model = model.to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(batch, 3, SIZE, SIZE, device=device).contiguous(
        memory_format=torch.channels_last
    )
    y = torch.randint(0, 1000, (batch,), device=device)
    on_cuda = device.type == "cuda"

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize()

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    sync()
    stop, done = threading.Event(), [0]

    def loop() -> None:
        stream = torch.cuda.Stream(device) if on_cuda else None
        while not stop.is_set() and done[0] < 10_000:
            if stream is None:
                work()
            else:
                with torch.cuda.stream(stream):
                    work()
                stream.synchronize()
            done[0] += 1

    thread = threading.Thread(target=loop, daemon=True) if work is not None else None
    if thread is not None:
        thread.start()
        time.sleep(0.5)
    began, before = time.perf_counter(), done[0]
    for _ in range(steps):
        step()
    sync()
    seconds = time.perf_counter() - began
    stop.set()
    if thread is not None:
        thread.join(timeout=60)
    name = "nothing" if work is None else work.__name__
    print(
        f"{model_name} step beside {name}: {1000 * seconds / steps:.1f} ms "
        f"({done[0] - before} batches decoded meanwhile)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--models", nargs="*", default=["resnet18", "resnet50"])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()

    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    from shardstream import Image, StreamingDataset
    from shardstream.gpu import BatchImageDecoder, _inputs

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_decode_profile: no CUDA device here (`--device cpu` makes a smoke run)")
    shards = sorted((args.data / "tar").glob("*.tar"))
    if not shards:
        shards = make_dataset(args.data / "tar", 8, args.batch, jobs=os.cpu_count() or 1)
    decoder = BatchImageDecoder(Image(SIZE, flip=0.5), device=device)
    dataset = StreamingDataset(
        [str(p) for p in shards],
        decode={"jpg": decoder.boxes},
        batch_size=args.batch,
        pack_bytes=True,
    )
    batch = next(iter(dataset))
    jpegs, boxes = _inputs(batch, "jpg")
    decoded = decoder._decode(jpegs)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    print(f"{len(jpegs)} JPEGs of {sorted(set(decoded.shapes))[:3]}", flush=True)
    timed(
        "decode_jpeg on the list",
        lambda: decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=device),
        sync,
        args.reps,
    )
    timed("decode (decode_jpeg and one buffer)", lambda: decoder._decode(jpegs), sync, args.reps)
    timed(
        "augment (pad, roi_align, flip, uint8)",
        lambda: decoder._augment(decoded, boxes),
        sync,
        args.reps,
    )
    timed("the whole decoder call", lambda: decoder(batch), sync, args.reps)

    def decode_only() -> None:
        decoder._decode(jpegs)

    def augment_only() -> None:
        decoder._augment(decoded, boxes)

    def whole() -> None:
        decoder(batch)

    for model in args.models:
        for work in (None, decode_only, augment_only, whole):
            step_with(model, work, device, args.batch, args.steps)


if __name__ == "__main__":
    main()

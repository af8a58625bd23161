"""Training benchmark behind `make bench-train`: images/s of ResNet training
(bf16 autocast, SGD, channels-last) fed by each loader, against the
accelerator's ceiling on batches already on it.

    python benches/train_bench.py --out bench-results [--models resnet18 resnet50]
        [--workers 4 8] [--batch 256] [--steps 40] [--warmup 10] [--persistent-workers]

Pipelines, over the same tar shards of 500x375 JPEGs (~45 KB, the size of
ImageNet's; made by `augment_bench.make_dataset`) and their labels:

- "shardstream Image": `decode={"jpg": shardstream.Image(224, flip=0.5),
  "cls": "int"}`, batches collated in Rust (`batch_size`),
  `DataLoader(batch_size=None, pin_memory=True)`;
- "shardstream GPU decode": `batch_size` with `pack_bytes=True` hands each
  batch's JPEGs as one pinned uint8 buffer and offsets, with each image's
  crop box and flip drawn from its header (`ImageBoxes`); the training
  process decodes them with `shardstream.gpu.BatchImageDecoder` (nvJPEG on
  the batch, one copy into a padded tensor, one `roi_align` and one flip)
  in `decode_ahead`'s thread, on a CUDA stream of its own, a batch or two
  ahead of the training step; the loader's workers only read headers and
  pack bytes;
- "shardstream + PIL", "webdataset + PIL", "litdata + PIL": each library
  hands out the JPEG bytes and the DataLoader workers run the usual recipe:
  PIL decode, `RandomResizedCrop(224)`, `RandomHorizontalFlip()`,
  `PILToTensor()`, default collate, `pin_memory=True`;
- "ceiling": one batch of random uint8 images made on the device, trained on
  repeatedly: what the model and device allow.

`--models none` trains nothing: the step only normalises the batch on the
device, so a pipeline's row is what it delivers there, its own ceiling.

Every pipeline hands uint8 `(N, 3, 224, 224)` to the same step, which
converts and normalises on the device. `warmup` steps are not timed; images/s
is over the next `steps` steps (synchronised with the device at both ends),
and CPU ms per image is the machine's busy time over the same steps (from
/proc/stat: every process and kernel thread; "cores busy" is that time over
the window's), and the workers' share is their user + system time
(DataLoader workers alive and those an epoch's end retired, from /proc and
`RUSAGE_CHILDREN`): the loader's cost, apart from the training loop's.
Each (pipeline, model, workers) runs in a fresh subprocess. A pipeline
whose library is not installed is reported as such. Without a CUDA device
the benchmark refuses to run unless `--device cpu` is given (a smoke run:
CPU figures are not training figures).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))

from augment_bench import make_dataset  # noqa: E402
from child_run import run_child  # noqa: E402

SIZE = 224
SEED = 0
SHUFFLE_BUFFER = 1000
CHILD_TIMEOUT = 3600
PIPELINES = (
    "ceiling",
    "shardstream Image",
    "shardstream GPU decode",
    "shardstream + PIL",
    "webdataset + PIL",
    "litdata + PIL",
)
# ImageNet's channel means and standard deviations, on the 0-255 scale.
MEAN = (123.675, 116.28, 103.53)
STD = (58.395, 57.12, 57.375)


def pil_transform(sample: dict[str, Any]) -> tuple[Any, int]:
    """The usual torchvision recipe on a sample of JPEG and label bytes:
    uint8 `(3, 224, 224)` and the label."""
    from PIL import Image
    from torchvision import transforms

    global _RECIPE
    if _RECIPE is None:
        _RECIPE = transforms.Compose(
            [
                transforms.RandomResizedCrop(SIZE),
                transforms.RandomHorizontalFlip(),
                transforms.PILToTensor(),
            ]
        )
    image = Image.open(io.BytesIO(sample["jpg"])).convert("RGB")
    return _RECIPE(image), int(sample["cls"])


_RECIPE: Any = None


def machine_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine so far, every core together:
    the first line of /proc/stat, every state but idle and iowait (guest
    time is part of user time there)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    if fields[0] != "cpu":
        raise RuntimeError(f"/proc/stat starts with {fields[0]!r}, not the cpu line")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds() -> tuple[float, float]:
    """User + system CPU seconds so far of this process, and of every
    process it started (DataLoader workers): those waited for
    (`RUSAGE_CHILDREN`: the workers of an epoch that ended) and those alive
    or not yet waited for, with what they waited for themselves (read from
    /proc). Each is counted once, so the figure only grows."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    tick = os.sysconf("SC_CLK_TCK")
    parents, cpu = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # After the parenthesised name: state, ppid, ..., utime (14th
            # field of the line), stime, cutime and cstime (17th).
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        parents[pid] = int(fields[1])
        cpu[pid] = sum(int(v) for v in fields[11:15]) / tick
    mine, descendants = {os.getpid()}, waited.ru_utime + waited.ru_stime
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in mine and pid not in mine:
                mine.add(pid)
                # A live process's cutime holds its waited-for children;
                # its own children still alive are counted on their own.
                descendants += cpu[pid]
                grew = True
    return usage.ru_utime + usage.ru_stime, descendants


def loader_for(
    pipeline: str, data: Path, batch: int, workers: int, pin: bool, persistent: bool
) -> Any:
    """The pipeline's DataLoader over `data` (tar shards under `data/tar`),
    yielding `(uint8 images, int64 labels)` or Rust batch dicts; with
    `persistent`, its workers stay from one epoch to the next."""
    from torch.utils.data import DataLoader, IterableDataset

    kept = {"persistent_workers": persistent and workers > 0}

    tars = sorted(str(p) for p in (data / "tar").glob("*.tar"))
    if pipeline == "shardstream Image":
        from shardstream import Image, StreamingDataset

        dataset = StreamingDataset(
            str(data / "tar"),
            seed=SEED,
            shuffle_buffer=SHUFFLE_BUFFER,
            decode={"jpg": Image(SIZE, flip=0.5), "cls": "int"},
            batch_size=batch,
        )
        return DataLoader(dataset, batch_size=None, num_workers=workers, pin_memory=pin, **kept)
    if pipeline == "shardstream GPU decode":
        from shardstream import StreamingDataset

        dataset = StreamingDataset(
            str(data / "tar"),
            seed=SEED,
            shuffle_buffer=SHUFFLE_BUFFER,
            decode={"jpg": gpu_decoder("cpu").boxes, "cls": "int"},
            batch_size=batch,
            pack_bytes=True,
        )
        return DataLoader(dataset, batch_size=None, num_workers=workers, pin_memory=pin, **kept)
    if pipeline == "shardstream + PIL":
        from shardstream import StreamingDataset

        raw: Any = StreamingDataset(str(data / "tar"), seed=SEED, shuffle_buffer=SHUFFLE_BUFFER)
    elif pipeline == "webdataset + PIL":
        import webdataset as wds

        raw = wds.WebDataset(
            tars,
            shardshuffle=100,
            nodesplitter=wds.split_by_node,
            workersplitter=wds.split_by_worker,
            seed=SEED,
        ).shuffle(SHUFFLE_BUFFER)
    elif pipeline == "litdata + PIL":
        import litdata

        raw = litdata.StreamingDataset(str(data / "litdata"), shuffle=True, seed=SEED)
    else:
        raise ValueError(f"unknown pipeline {pipeline!r}")

    class Transformed(IterableDataset):
        def __iter__(self) -> Iterator[tuple[Any, int]]:
            return map(pil_transform, raw)

    return DataLoader(Transformed(), batch_size=batch, num_workers=workers, pin_memory=pin, **kept)


def gpu_decoder(device: Any) -> Any:
    """`shardstream.gpu.BatchImageDecoder` of `Image(224, flip=0.5)` on `device`."""
    from shardstream import Image
    from shardstream.gpu import BatchImageDecoder

    return BatchImageDecoder(Image(SIZE, flip=0.5), device=device)


def epochs(loader: Any) -> Iterator[Any]:
    """The loader's batches, epoch after epoch."""
    epoch = 0
    while True:
        dataset = getattr(loader, "dataset", None)
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        got = 0
        for batch in loader:
            got += 1
            yield batch
        if got == 0:
            raise RuntimeError("the loader yielded no batch")
        epoch += 1


def batches(pipeline: str, loader: Any, device: Any) -> Iterator[tuple[Any, Any]]:
    """`(images, labels)` from the loader, epoch after epoch (packed JPEGs
    decoded and augmented on `device` by a thread, a batch or two ahead)."""
    if pipeline == "shardstream GPU decode":
        ahead = gpu_decoder(device).decode_ahead(epochs(loader))
        try:
            for batch in ahead:
                yield batch["jpg"], batch["cls"]
        finally:
            ahead.close()
        return
    for batch in epochs(loader):
        if isinstance(batch, dict):
            yield batch["jpg"], batch["cls"]
        else:
            yield batch[0], batch[1]


def run(pipeline: str, data: Path, model_name: str, batch: int, workers: int, args: Any) -> dict:
    """One measurement in this process."""
    import torch
    import torchvision

    device = torch.device(args.device)
    torch.manual_seed(SEED)
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
    if model_name == "none":
        # What the pipeline delivers on the device with no model to train:
        # the step only normalises the batch (and so reads every byte).
        model = None
    else:
        model = getattr(torchvision.models, model_name)(num_classes=1000)
        model = model.to(device, memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        criterion = torch.nn.CrossEntropyLoss()

    def step(images: Any, labels: Any) -> None:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, SIZE, SIZE)
        x = ((images.float() - mean) / std).contiguous(memory_format=torch.channels_last)
        if model is None:
            return
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = criterion(model(x), labels % 1000)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    if pipeline == "ceiling":
        images = torch.randint(0, 256, (batch, 3, SIZE, SIZE), dtype=torch.uint8, device=device)
        labels = torch.randint(0, 1000, (batch,), device=device)
        source: Iterator[tuple[Any, Any]] = iter(lambda: (images, labels), None)
    else:
        pin = device.type == "cuda" and not args.no_pin_memory
        loader = loader_for(pipeline, data, batch, workers, pin, args.persistent_workers)
        source = batches(pipeline, loader, device)
    for _ in range(args.warmup):
        step(*next(source))
    sync()
    start, start_cpu, start_busy, seen = (
        time.perf_counter(),
        tree_cpu_seconds(),
        machine_busy_seconds(),
        0,
    )
    step_seconds = []
    for _ in range(args.steps):
        began = time.perf_counter()
        images, labels = next(source)
        seen += len(images)
        step(images, labels)
        step_seconds.append(time.perf_counter() - began)
    sync()
    seconds, end_cpu = time.perf_counter() - start, tree_cpu_seconds()
    busy = machine_busy_seconds() - start_busy
    # The loader's threads (decode_ahead's) stop before the process ends.
    close = getattr(source, "close", None)
    if close is not None:
        close()
    own, workers_cpu = (end - begin for end, begin in zip(end_cpu, start_cpu, strict=True))
    return {
        "images": seen,
        "seconds": seconds,
        # The machine's busy time over the window: what the run cost,
        # whatever process (or kernel thread) spent it.
        "cpu_seconds": busy,
        "tree_cpu_seconds": own + workers_cpu,
        "worker_cpu_seconds": workers_cpu,
        # The host's time per step (the device runs behind it): a stall
        # at an epoch's end shows as the slowest step.
        "median_step_seconds": statistics.median(step_seconds),
        "slowest_step_seconds": max(step_seconds),
    }


def available(pipeline: str) -> bool:
    """Whether the pipeline's library can be imported here."""
    module = {"webdataset + PIL": "webdataset", "litdata + PIL": "litdata"}.get(pipeline)
    if module is None:
        return True
    import importlib.util

    return importlib.util.find_spec(module) is not None


def prepare(root: Path, shards: int, per_shard: int, pipelines: list[str]) -> Path:
    """The shards under `root/tar`, and LitData's copy under `root/litdata`
    when that pipeline runs."""
    paths = make_dataset(root / "tar", shards, per_shard, jobs=os.cpu_count() or 1)
    if "litdata + PIL" in pipelines and available("litdata + PIL"):
        payload = sum(p.stat().st_size for p in paths)
        (root / "meta.json").write_text(json.dumps({"payload_bytes": payload}))
        subprocess.run(
            [sys.executable, __file__, "--convert-litdata", str(root)],
            check=True,
            timeout=CHILD_TIMEOUT,
        )
    return root


def child_args(args: Any) -> list[str]:
    return [
        "--device",
        args.device,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        *(["--persistent-workers"] if args.persistent_workers else []),
        *(["--no-pin-memory"] if args.no_pin_memory else []),
    ]


def measure(pipeline: str, data: Path, model: str, batch: int, workers: int, args: Any) -> dict:
    """`run` in a fresh subprocess."""
    child = [pipeline, str(data), model, str(batch), str(workers)]
    return run_child(__file__, child, before=child_args(args), timeout=CHILD_TIMEOUT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument(
        "--data", type=Path, help="where the shards are made (and kept); default OUT/train-data"
    )
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument("--models", nargs="+", default=["resnet18", "resnet50"])
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--persistent-workers",
        action="store_true",
        help="DataLoader workers that stay between epochs (with --steps past an epoch)",
    )
    parser.add_argument(
        "--no-pin-memory",
        action="store_true",
        help="DataLoader(pin_memory=False) on CUDA too (nvJPEG reads pageable memory itself)",
    )
    parser.add_argument("--shards", type=int, default=80)
    parser.add_argument("--per-shard", type=int, default=500)
    parser.add_argument("--pipelines", nargs="+", default=list(PIPELINES), choices=PIPELINES)
    parser.add_argument("--child", nargs=5, metavar=("PIPELINE", "DATA", "MODEL", "BATCH", "W"))
    parser.add_argument("--convert-litdata", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.convert_litdata:
        from peers_bench import convert_litdata

        convert_litdata(args.convert_litdata)
        return
    import torch

    if args.device is None:
        if not torch.cuda.is_available():
            sys.exit(
                "train_bench: no CUDA device here; the training benchmark needs one "
                "(`--device cpu` runs it on the CPU as a smoke run, not a measurement)"
            )
        args.device = "cuda"
    if args.child:
        pipeline, data, model, batch, workers = args.child
        result = run(pipeline, Path(data), model, int(batch), int(workers), args)
        print(json.dumps(result))
        return

    data_root = args.data if args.data is not None else args.out / "train-data"
    data = prepare(data_root, args.shards, args.per_shard, args.pipelines)
    rows = []
    for model in args.models:
        for workers in args.workers:
            for pipeline in args.pipelines:
                if pipeline == "ceiling" and workers != args.workers[0]:
                    continue
                row: dict[str, Any] = {"model": model, "workers": workers, "pipeline": pipeline}
                if not available(pipeline):
                    row["error"] = "not installed"
                    rows.append(row)
                    continue
                runs = [
                    measure(pipeline, data, model, args.batch, workers, args)
                    for _ in range(args.repeats)
                ]
                row["images"] = runs[0]["images"]
                row["images_per_s"] = statistics.median(r["images"] / r["seconds"] for r in runs)
                row["cpu_ms_per_image"] = statistics.median(
                    1000 * r["cpu_seconds"] / r["images"] for r in runs
                )
                row["cores_busy"] = statistics.median(r["cpu_seconds"] / r["seconds"] for r in runs)
                row["worker_cpu_ms_per_image"] = statistics.median(
                    1000 * r["worker_cpu_seconds"] / r["images"] for r in runs
                )
                for key in ("median_step_seconds", "slowest_step_seconds"):
                    row[key] = statistics.median(r[key] for r in runs)
                rows.append(row)
                print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_bench.json").write_text(json.dumps(rows, indent=2))
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(
        f"\n{device}, {os.cpu_count()} cores, batch {args.batch}, bf16, "
        f"{args.steps} timed steps after {args.warmup}"
    )
    print(
        "| model | workers | pipeline | images/s | of ceiling | cores busy "
        "| CPU ms per image | the loader's workers | median step | slowest step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        ceiling = next(
            (
                r.get("images_per_s")
                for r in rows
                if r["model"] == row["model"] and r["pipeline"] == "ceiling"
            ),
            None,
        )
        if "error" in row:
            print(
                f"| {row['model']} | {row['workers']} | {row['pipeline']} | {row['error']} "
                "| | | | | | |"
            )
            continue
        share = f"{row['images_per_s'] / ceiling:.0%}" if ceiling else "-"
        workers = "-" if row["pipeline"] == "ceiling" else row["workers"]
        print(
            f"| {row['model']} | {workers} | {row['pipeline']} | {row['images_per_s']:,.0f} "
            f"| {share} | {row['cores_busy']:.2f} | {row['cpu_ms_per_image']:.2f} "
            f"| {row['worker_cpu_ms_per_image']:.2f} "
            f"| {1000 * row['median_step_seconds']:.1f} ms "
            f"| {1000 * row['slowest_step_seconds']:.1f} ms |"
        )


if __name__ == "__main__":
    main()

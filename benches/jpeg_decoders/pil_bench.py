"""PIL + torchvision reference for the JPEG decoder bench (``benches/jpeg_decoders``).

Per-image CPU time (``time.thread_time``, one thread, torch at one thread)
and wall time of three variants over the images of a folder:

- decode: ``Image.open(BytesIO(b)).convert("RGB")``;
- pipeline: that + ``Compose([RandomResizedCrop(224), RandomHorizontalFlip(),
  PILToTensor()])``, torchvision drawing its own boxes, as
  ``benches/augment_bench.py`` (uint8 output, as shardstream's ``Image``);
- fixed boxes: the decode + ``F.resized_crop`` to 224x224 (bilinear,
  antialiased) of the box of ``boxes.txt`` + ``F.hflip`` where flagged +
  ``F.pil_to_tensor``: the boxes the Rust bench crops.

Each pass runs every variant over all images, one variant after the other;
a first warm-up pass is not counted. Printed: the median over passes of the
mean per image, with the fastest and slowest pass. With ``RAW=<file>`` the
per-pass figures are appended to that CSV file for ``summarize.py``.

    python pil_bench.py IMAGE_DIR BOXES_FILE [PASSES]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import PIL
import torch
import torchvision
from PIL import Image, features
from torchvision import transforms
from torchvision.transforms import functional as F

Box = tuple[int, int, int, int, int]

torch.set_num_threads(1)
torch.set_num_interop_threads(1)
torch.manual_seed(0)
RANDOM_PIPELINE = transforms.Compose(
    [transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.PILToTensor()]
)


def decode(b: bytes, box: Box) -> Image.Image:
    """The JPEG decoded to RGB."""
    return Image.open(io.BytesIO(b)).convert("RGB")


def pipeline(b: bytes, box: Box) -> torch.Tensor:
    """Decode + RandomResizedCrop(224) + flip, torchvision's own boxes."""
    return RANDOM_PIPELINE(decode(b, box))


def fixed(b: bytes, box: Box) -> torch.Tensor:
    """Decode + the given box resized to 224x224 + flip where flagged."""
    x, y, w, h, flip = box
    im = F.resized_crop(
        decode(b, box),
        y,
        x,
        h,
        w,
        [224, 224],
        transforms.InterpolationMode.BILINEAR,
        antialias=True,
    )
    if flip:
        im = F.hflip(im)
    return F.pil_to_tensor(im)


VARIANTS: dict[str, Callable[[bytes, Box], object]] = {
    "PIL decode (open+convert RGB)": decode,
    "PIL decode+RRC224+flip+PILToTensor (torchvision random boxes)": pipeline,
    "PIL decode+resized_crop(fixed boxes)+flip+pil_to_tensor": fixed,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("images", help="folder of .jpg files")
    parser.add_argument("boxes", type=Path, help="boxes.txt, one line per image")
    parser.add_argument("passes", type=int, nargs="?", default=7, help="counted passes")
    args = parser.parse_args()
    files = [p.read_bytes() for p in sorted(Path(args.images).glob("*.jpg"))]
    boxes: list[Box] = []
    for line in args.boxes.read_text().splitlines():
        x, y, w, h, flip = map(int, line.split())
        boxes.append((x, y, w, h, flip))
    assert files and len(files) == len(boxes), "one box per image"

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    for p in range(args.passes + 1):
        for name, f in VARIANTS.items():
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            for b, box in zip(files, boxes, strict=True):
                f(b, box)
            cpu = (time.thread_time_ns() - c0) / 1e6 / len(files)
            wall = (time.perf_counter_ns() - w0) / 1e6 / len(files)
            if p:
                times[name].append((cpu, wall))
    if os.environ.get("RAW"):
        with open(os.environ["RAW"], "a") as out:
            for name, t in times.items():
                for cpu, wall in t:
                    label = name.replace(",", ";")
                    out.write(f"pil,{args.images},{label},{cpu:.5f},{wall:.5f}\n")
    print(
        f"# {len(files)} images from {args.images}, {args.passes} passes (+1 warm-up), "
        f"ms per image; Pillow {PIL.__version__} "
        f"(libjpeg-turbo {features.version_feature('libjpeg_turbo')}), "
        f"torch {torch.__version__}, torchvision {torchvision.__version__}"
    )
    print("| variant | CPU ms median | CPU min-max | wall ms median | wall min-max |")
    print("|---|---|---|---|---|")
    for name, t in times.items():
        c = [x[0] for x in t]
        w = [x[1] for x in t]
        print(
            f"| {name} | {statistics.median(c):.3f} | {min(c):.3f}-{max(c):.3f} | "
            f"{statistics.median(w):.3f} | {min(w):.3f}-{max(w):.3f} |"
        )


if __name__ == "__main__":
    main()

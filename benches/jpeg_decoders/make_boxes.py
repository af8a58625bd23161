"""RandomResizedCrop boxes for the JPEG decoder bench (``benches/jpeg_decoders``).

Writes one line per image, ``x y w h flip``: a box drawn by torchvision's own
``RandomResizedCrop.get_params`` for a 500x375 image (scale (0.08, 1), ratio
(3/4, 4/3)) after ``torch.manual_seed(0)``, and a horizontal-flip flag
(probability 1/2). The Rust bench and ``pil_bench.py``'s fixed-box variant
read the same file, so both crop the same boxes.

    python make_boxes.py OUT_FILE [--count 200]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from PIL import Image
from torchvision import transforms

W, H = 500, 375


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the file to write (boxes.txt)")
    parser.add_argument("--count", type=int, default=200, help="boxes, one per image")
    args = parser.parse_args()
    torch.manual_seed(0)
    img = Image.new("RGB", (W, H))
    lines = []
    for _ in range(args.count):
        # get_params returns (top, left, height, width).
        top, left, h, w = transforms.RandomResizedCrop.get_params(img, (0.08, 1.0), (3 / 4, 4 / 3))
        flip = int(torch.rand(1) < 0.5)
        lines.append(f"{left} {top} {w} {h} {flip}\n")
    args.out.write_text("".join(lines))


if __name__ == "__main__":
    main()

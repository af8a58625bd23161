"""Test JPEGs for the JPEG decoder bench (``benches/jpeg_decoders``).

Writes two sets of 200 JPEGs of 500x375 into the folder given:

- ``images/``: photo-like pictures: a two-colour gradient with low-frequency
  blobs, two layers of ellipses, rectangles, polygons and lines (the first
  layer blurred as if out of focus), lighting falloff, 1-3 textured
  (sinusoid x noise) patches, 1/f ("pink", natural-image spectrum) texture
  over the whole picture (luminance sd 14, per-channel sd 5) and Gaussian
  sensor noise (sd 3). Saved by PIL at quality 90, 4:2:0, baseline, not
  optimized (about 70 KB each).
- ``images_waves85/``: made exactly as ``benches/augment_bench.py``'s
  ``make_dataset()`` does (sine waves + noise sd 7, quality 85, seeds
  ``(0, 0, i)``): the images behind docs/performance.md's augmentation
  figures (about 42 KB each).

Deterministic: every image has its own seeded numpy generator.

    python gen_images.py OUT_DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

COUNT = 200
W, H = 500, 375
Y, X = np.mgrid[0:H, 0:W].astype(np.float64)


def pink(rng: np.random.Generator, amp: float) -> np.ndarray:
    """1/f noise of standard deviation ``amp``, H x W."""
    f = np.sqrt(np.fft.fftfreq(H)[:, None] ** 2 + np.fft.rfftfreq(W)[None, :] ** 2)
    f[0, 0] = 1
    spec = (rng.normal(size=f.shape) + 1j * rng.normal(size=f.shape)) / f
    n = np.fft.irfft2(spec, s=(H, W))
    return amp * n / n.std()


def shapes(rng: np.random.Generator, base: Image.Image) -> Image.Image:
    """Two layers of random shapes over ``base``, the first one blurred."""
    for layer in range(2):
        over = base.copy()
        d = ImageDraw.Draw(over)
        for _ in range(rng.integers(6, 14)):
            col = tuple(int(v) for v in rng.uniform(0, 255, 3))
            x0, y0 = rng.uniform(-50, W), rng.uniform(-50, H)
            w, h = rng.uniform(20, 220), rng.uniform(20, 180)
            kind = rng.integers(0, 4)
            if kind == 0:
                d.ellipse([x0, y0, x0 + w, y0 + h], fill=col)
            elif kind == 1:
                d.rectangle([x0, y0, x0 + w, y0 + h], fill=col)
            elif kind == 2:
                pts = [
                    (x0 + rng.uniform(0, w), y0 + rng.uniform(0, h))
                    for _ in range(rng.integers(3, 7))
                ]
                d.polygon(pts, fill=col)
            else:
                d.line([x0, y0, x0 + w, y0 + h], fill=col, width=int(rng.integers(1, 6)))
        if layer == 0:
            over = over.filter(ImageFilter.GaussianBlur(rng.uniform(2, 6)))
        base = over
    return base


def photo(i: int) -> Image.Image:
    """Photo-like picture number ``i``."""
    rng = np.random.default_rng((1234, i))
    # Background: a two-colour gradient along a random direction, and blobs.
    a = rng.uniform(0, 2 * np.pi)
    t = ((X - W / 2) * np.cos(a) + (Y - H / 2) * np.sin(a)) / 400 + 0.5
    c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    img = c0 * (1 - t[..., None]) + c1 * t[..., None]
    for _ in range(4):
        cx, cy, s = rng.uniform(0, W), rng.uniform(0, H), rng.uniform(40, 160)
        blob = np.exp(-((X - cx) ** 2 + (Y - cy) ** 2) / (2 * s * s))
        img += rng.uniform(-60, 60, 3) * blob[..., None]
    base = shapes(rng, Image.fromarray(img.clip(0, 255).astype(np.uint8)))
    arr = np.asarray(base).astype(np.float64)
    # Lighting across the picture.
    arr *= (0.75 + 0.25 * np.cos((X / W - rng.uniform()) * np.pi))[..., None]
    # A few textured patches (foliage or fabric).
    for _ in range(rng.integers(1, 4)):
        cx, cy = rng.integers(0, W), rng.integers(0, H)
        pw, ph = rng.integers(60, 180), rng.integers(50, 140)
        sl = (
            slice(max(cy - ph // 2, 0), min(cy + ph // 2, H)),
            slice(max(cx - pw // 2, 0), min(cx + pw // 2, W)),
        )
        f = rng.uniform(0.2, 1.2)
        tex = 25 * np.sin(X[sl] * f + rng.uniform(0, 6)) * np.sin(
            Y[sl] * f * rng.uniform(0.5, 2)
        ) + rng.normal(0, 12, X[sl].shape)
        arr[sl] += tex[..., None] * rng.uniform(0.5, 1, 3)
    # Natural-image detail: 1/f noise, partly shared by the channels
    # (luminance texture) and partly not (colour texture); sensor noise.
    lum = pink(rng, 14)
    for c in range(3):
        arr[..., c] += lum + pink(rng, 5)
    arr += rng.normal(0, 3, arr.shape)
    return Image.fromarray(arr.clip(0, 255).astype(np.uint8))


def waves(i: int) -> Image.Image:
    """Image ``i`` of shard 0 of ``benches/augment_bench.py``'s ``make_dataset()``."""
    yy, xx = np.mgrid[0:375, 0:500]
    rng = np.random.default_rng((0, 0, i))
    phase = rng.uniform(0, 6.28, 3)
    scale = rng.uniform(5, 40, 3)
    ch = [128 + 90 * np.sin(xx / s + yy / (s * 1.7) + p) for s, p in zip(scale, phase, strict=True)]
    im = np.stack(ch, -1) + rng.normal(0, 7, (375, 500, 3))
    return Image.fromarray(im.clip(0, 255).astype(np.uint8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for images/ and images_waves85/")
    out = parser.parse_args().out
    sizes: dict[str, list[int]] = {"images": [], "images_waves85": []}
    for name in sizes:
        (out / name).mkdir(parents=True, exist_ok=True)
    for i in range(COUNT):
        p = out / "images" / f"{i:03d}.jpg"
        photo(i).save(p, "JPEG", quality=90, subsampling=2, progressive=False, optimize=False)
        sizes["images"].append(p.stat().st_size)
        p = out / "images_waves85" / f"{i:03d}.jpg"
        waves(i).save(p, "JPEG", quality=85)
        sizes["images_waves85"].append(p.stat().st_size)
    for name, v in sizes.items():
        print(
            f"{name}: {len(v)} JPEGs, mean {np.mean(v) / 1e3:.1f} KB, "
            f"min {min(v) / 1e3:.1f}, max {max(v) / 1e3:.1f}"
        )


if __name__ == "__main__":
    main()

"""Decoding a batch of JPEGs on a GPU, with the crops and flips of
``shardstream.Image``: ``BatchImageDecoder`` (needs torch and torchvision).

The loader's workers only read each JPEG's header and draw its box and flip
(``ImageBoxes``: the very draws ``Image`` makes for that sample, so an
epoch's augmentation is the same whichever side decodes); the GPU decodes the
batch with nvJPEG (``torchvision.io.decode_jpeg`` on a list) and crops,
resizes and flips it with one ``roi_align`` and one ``where`` per chunk of
the batch. ``import shardstream`` does not import this module; see
``docs/augment.md``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torchvision.io import ImageReadMode, decode_jpeg  # type: ignore[import-untyped]
from torchvision.ops import roi_align  # type: ignore[import-untyped]

from ._core import Image, ImageBoxes

__all__ = ["BatchImageDecoder"]


class BatchImageDecoder:
    """Decodes the JPEG field of a batch on ``device`` to the images ``image``
    gives: ``(B, 3, H, W)`` (or ``(B, H, W, 3)`` with ``layout="HWC"``)
    ``uint8``, or ``float32`` in 0-255 with ``dtype=torch.float32``.

    Put ``decoder.boxes`` in the dataset's ``decode`` for the field, with a
    ``batch_size`` (and ``pack_bytes=True``, so that each batch's JPEGs come
    as one buffer), and call the decoder on each batch::

        decoder = BatchImageDecoder(Image(224, flip=0.5), device="cuda")
        ds = StreamingDataset(spec, batch_size=256, pack_bytes=True,
                              decode={"jpg": decoder.boxes, "cls": "int"})
        for batch in DataLoader(ds, batch_size=None, num_workers=4, pin_memory=True):
            images = decoder(batch)          # the "jpg" field, on the GPU

    Resampling is ``roi_align``'s (bilinear, averaging ``ceil(box / output)``
    points per output pixel in each direction), close to ``Image``'s
    antialiased resampling but not equal to it; boxes and flips are equal.
    Images are padded into one tensor per chunk of at most
    ``max_padded_bytes`` (float32, each image's last row and column
    repeated once so that sampling at its edge never reads the padding).
    """

    def __init__(
        self,
        image: Image,
        *,
        device: str | torch.device = "cuda",
        dtype: torch.dtype = torch.uint8,
        max_padded_bytes: int = 512 << 20,
    ) -> None:
        if dtype not in (torch.uint8, torch.float32):
            raise ValueError(
                f"invalid BatchImageDecoder parameter dtype: torch.uint8 or torch.float32, "
                f"got {dtype}"
            )
        if not isinstance(max_padded_bytes, int) or max_padded_bytes <= 0:
            raise ValueError(
                "invalid BatchImageDecoder parameter max_padded_bytes: a positive int, "
                f"got {max_padded_bytes!r}"
            )
        #: What ``decode={field: ...}`` takes: the field's JPEG left as it is
        #: and ``<field>_box`` beside it.
        self.boxes = ImageBoxes(image)
        self.image = image
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_padded_bytes = max_padded_bytes
        # ImageBoxes refuses an Image without an output size.
        self.size = cast("tuple[int, int]", image.size)

    def __call__(self, batch: Mapping[str, Any], field: str = "jpg") -> torch.Tensor:
        """The images of ``batch[field]`` (packed bytes with
        ``<field>_offsets``, or a list of ``bytes``) with ``<field>_box``."""
        if f"{field}_box" not in batch:
            raise KeyError(
                f"the batch has no field {field}_box: decode the field {field!r} with "
                "decoder.boxes (and give the dataset a batch_size)"
            )
        jpegs = _members(batch, field)
        boxes = torch.as_tensor(batch[f"{field}_box"], dtype=torch.float32)
        if boxes.ndim != 2 or boxes.shape != (len(jpegs), 5):
            raise ValueError(
                f"{field}_box has shape {tuple(boxes.shape)}, expected ({len(jpegs)}, 5)"
            )
        images = decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=self.device)
        if isinstance(images, torch.Tensor):
            images = [images]
        boxes = boxes.to(self.device, non_blocking=True)
        height, width = self.size
        out = torch.empty((len(images), 3, height, width), dtype=torch.float32, device=self.device)
        for start, stop in self._chunks(images):
            out[start:stop] = self._resample(images[start:stop], boxes[start:stop])
        flipped = (boxes[:, 4] > 0.5).view(-1, 1, 1, 1)
        out = torch.where(flipped, out.flip(-1), out)
        if self.dtype == torch.uint8:
            out = out.round_().clamp_(0, 255).to(torch.uint8)
        if self.image.layout == "HWC":
            out = out.permute(0, 2, 3, 1).contiguous()
        return out

    def _chunks(self, images: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
        """Runs of images whose padded float32 tensor fits ``max_padded_bytes``
        (an image alone is always a run)."""
        chunks, start, tall, wide = [], 0, 0, 0
        for i, image in enumerate(images):
            h, w = image.shape[-2] + 1, image.shape[-1] + 1
            grown_h, grown_w = max(tall, h), max(wide, w)
            if i > start and (i - start + 1) * 3 * grown_h * grown_w * 4 > self.max_padded_bytes:
                chunks.append((start, i))
                start, grown_h, grown_w = i, h, w
            tall, wide = grown_h, grown_w
        if images:
            chunks.append((start, len(images)))
        return chunks

    def _resample(self, images: Sequence[torch.Tensor], boxes: torch.Tensor) -> torch.Tensor:
        """One ``roi_align`` of the padded images over their boxes."""
        tall = max(image.shape[-2] for image in images) + 1
        wide = max(image.shape[-1] for image in images) + 1
        padded = torch.zeros((len(images), 3, tall, wide), dtype=torch.float32, device=self.device)
        for i, image in enumerate(images):
            rows, cols = image.shape[-2:]
            edged = F.pad(image.unsqueeze(0).float(), (0, 1, 0, 1), mode="replicate")
            padded[i, :, : rows + 1, : cols + 1] = edged[0]
        index = torch.arange(len(images), dtype=torch.float32, device=self.device)
        x, y, w, h = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
        rois = torch.stack([index, x, y, x + w, y + h], dim=1)
        return roi_align(padded, rois, output_size=self.size, sampling_ratio=0, aligned=True)


def _members(batch: Mapping[str, Any], field: str) -> list[torch.Tensor]:
    """The batch's JPEGs as uint8 CPU tensors (views of one packed buffer)."""
    data = batch[field]
    offsets = batch.get(f"{field}_offsets")
    if offsets is not None:
        buffer = torch.as_tensor(data)
        bounds = torch.as_tensor(offsets).tolist()
        return [buffer[a:b] for a, b in itertools.pairwise(bounds)]
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = [data]
    return [torch.frombuffer(bytearray(member), dtype=torch.uint8) for member in data]

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
import queue
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
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
        """One ``roi_align`` of the images, padded into one tensor, over their
        boxes."""
        index = torch.arange(len(images), dtype=torch.float32, device=self.device)
        x, y, w, h = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
        rois = torch.stack([index, x, y, x + w, y + h], dim=1)
        padded = _padded(images, self.device)
        return roi_align(padded, rois, output_size=self.size, sampling_ratio=0, aligned=True)

    def decode_ahead(
        self, batches: Iterable[Mapping[str, Any]], *, field: str = "jpg", depth: int = 2
    ) -> Iterator[dict[str, Any]]:
        """The batches of ``batches`` (a ``DataLoader``, say), each with
        ``field`` decoded: a thread takes the next ``depth`` batches from
        ``batches`` and decodes them on a CUDA stream of its own while the
        caller trains on the current one, so that the decode (nvJPEG waits for
        its batch) neither holds up the training step's launches nor waits
        for them. Each batch comes as a ``dict``: its fields, ``field`` the
        images on ``device`` (ready for the caller's current stream), and
        ``<field>_offsets`` left out.

        ``batches`` belongs to the thread until the iterator ends or is
        closed; an error met there (reading or decoding) is raised here, at
        the batch it concerns. Closing the iterator (``break``, garbage
        collection) stops the thread after the batch it is on."""
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(
                f"invalid decode_ahead parameter depth: an int of at least 1, got {depth!r}"
            )
        return _DecodeAhead(self, iter(batches), field, depth).batches()

    def _decode_batch(self, batch: Mapping[str, Any], field: str) -> dict[str, Any]:
        """``batch`` as a dict with ``field`` decoded (and no offsets)."""
        out = {k: v for k, v in batch.items() if k != f"{field}_offsets"}
        out[field] = self(batch, field)
        return out


# How long the thread of ``decode_ahead`` waits at a time for room in its
# queue before it looks again whether it should stop, and how long closing
# waits for it to end.
_POLL_SECONDS = 0.1
_CLOSE_SECONDS = 60.0


class _DecodeAhead:
    """The thread and queue behind ``BatchImageDecoder.decode_ahead``."""

    def __init__(
        self, decoder: BatchImageDecoder, source: Iterator[Any], field: str, depth: int
    ) -> None:
        self.decoder = decoder
        self.source = source
        self.field = field
        self.queue: queue.Queue[tuple[str, Any, Any]] = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        on_cuda = decoder.device.type == "cuda"
        self.stream = torch.cuda.Stream(decoder.device) if on_cuda else None
        self.thread = threading.Thread(
            target=self._run, name="shardstream-decode-ahead", daemon=True
        )

    def _put(self, item: tuple[str, Any, Any]) -> bool:
        """Puts ``item`` when there is room; False if told to stop first."""
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    batch = next(self.source)
                except StopIteration:
                    self._put(("end", None, None))
                    return
                item: tuple[str, Any, Any]
                if self.stream is None:
                    item = ("batch", self.decoder._decode_batch(batch, self.field), None)
                else:
                    with torch.cuda.stream(self.stream):
                        decoded = self.decoder._decode_batch(batch, self.field)
                        done = torch.cuda.Event()
                        done.record(self.stream)
                    item = ("batch", decoded, done)
                if not self._put(item):
                    return
        except BaseException as error:  # raised again in the caller
            self._put(("error", error, None))

    def batches(self) -> Iterator[dict[str, Any]]:
        self.thread.start()
        try:
            while True:
                kind, value, done = self.queue.get()
                if kind == "end":
                    return
                if kind == "error":
                    raise value
                if done is not None:
                    current = torch.cuda.current_stream(self.decoder.device)
                    current.wait_event(done)
                    # The images were made on the thread's stream: the
                    # allocator must not hand their memory out again before
                    # the caller's stream is done with them.
                    value[self.field].record_stream(current)
                yield value
        finally:
            self.stop.set()
            self.thread.join(timeout=_CLOSE_SECONDS)


def _padded(images: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The ``(3, h, w)`` images in one float32 ``(B, 3, H + 1, W + 1)``
    tensor, each image's last row and column repeated to fill its padding
    (so that bilinear sampling at its edge reads the edge): one
    concatenation and one gather, whatever the number of images."""
    heights = torch.tensor([image.shape[-2] for image in images])
    widths = torch.tensor([image.shape[-1] for image in images])
    tall, wide = int(heights.max()) + 1, int(widths.max()) + 1
    flat = torch.cat([image.reshape(-1) for image in images])
    dtype = torch.int32 if flat.numel() < 2**31 else torch.int64
    plane = heights * widths
    starts = torch.cumsum(3 * plane, 0) - 3 * plane
    # Offsets in `flat` of each image's channel planes, of each padded row's
    # source row, and of each padded column's source column.
    planes = starts[:, None] + torch.arange(3)[None, :] * plane[:, None]
    rows = torch.minimum(torch.arange(tall)[None, :], heights[:, None] - 1) * widths[:, None]
    cols = torch.minimum(torch.arange(wide)[None, :], widths[:, None] - 1)
    planes, rows, cols = (t.to(device=device, dtype=dtype) for t in (planes, rows, cols))
    index = planes[:, :, None, None] + rows[:, None, :, None]
    index = index + cols[:, None, None, :]
    return flat[index].float()


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

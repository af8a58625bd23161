"""Decoding a batch of JPEGs on a GPU, with the crops and flips of
``shardstream.Image``: ``BatchImageDecoder`` (needs torch and torchvision).

The loader's workers only read each JPEG's header and draw its box and flip
(``ImageBoxes``: the very draws ``Image`` makes for that sample, so an
epoch's augmentation is the same whichever side decodes); the GPU decodes the
batch with nvJPEG (``torchvision.io.decode_jpeg`` on a list) and crops
and resizes it with one ``roi_align`` per chunk of the batch, then flips it
with one ``where``; ``decode_ahead`` does all that in a thread, a batch or
more ahead of the training loop. ``import shardstream`` does not import
this module; see ``docs/augment.md``.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import queue
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple, cast

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_jpeg  # type: ignore[import-untyped]
from torchvision.ops import roi_align  # type: ignore[import-untyped]

from ._core import Image, ImageBoxes

__all__ = ["BatchImageDecoder", "DecodeAhead"]


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
    ``max_padded_bytes`` (in ``uint8`` and then float32, 5 bytes a value;
    each image's last row and column repeated once so that sampling at its
    edge never reads the padding).
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
        ``<field>_offsets``, or a list of ``bytes``) with ``<field>_box``,
        made on the current stream."""
        jpegs, boxes = _inputs(batch, field)
        return self._augment(self._decode(jpegs), boxes)

    def _decode(self, jpegs: list[torch.Tensor]) -> _Decoded:
        """The JPEGs decoded (nvJPEG waits for its batch), one after the
        other in one buffer."""
        images = decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=self.device)
        if isinstance(images, torch.Tensor):
            images = [images]
        shapes = [(image.shape[-2], image.shape[-1]) for image in images]
        # A window as wide as the widest image (plus its repeated column)
        # starts at every pixel: the zeros after the last one.
        tail = torch.zeros(max(w for _, w in shapes) + 1, dtype=torch.uint8, device=self.device)
        pixels = torch.cat([image.reshape(-1) for image in images] + [tail])
        return _Decoded(pixels, shapes)

    def _augment(self, decoded: _Decoded, boxes: np.ndarray) -> torch.Tensor:
        """The decoded images cropped, resized and flipped by their boxes:
        a fixed number of kernel launches per chunk of the batch."""
        height, width = self.size
        count = len(decoded.shapes)
        pixels = decoded.pixels
        chunks = self._chunks(decoded.shapes)
        if len(chunks) == 1:
            out = self._resample(pixels, decoded.shapes, boxes, 0, count)
        else:
            out = torch.empty((count, 3, height, width), dtype=torch.float32, device=self.device)
            for start, stop in chunks:
                out[start:stop] = self._resample(pixels, decoded.shapes, boxes, start, stop)
        flips = torch.from_numpy(boxes[:, 4] > 0.5).to(self.device).view(-1, 1, 1, 1)
        out = torch.where(flips, out.flip(-1), out)
        if self.dtype == torch.uint8:
            out = out.round_().clamp_(0, 255).to(torch.uint8)
        if self.image.layout == "HWC":
            out = out.permute(0, 2, 3, 1).contiguous()
        return out

    def _chunks(self, shapes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Runs of images whose padded tensor, in ``uint8`` and in float32
        (5 bytes a value while both are held), fits ``max_padded_bytes``
        (an image alone is always a run)."""
        chunks, start, tall, wide = [], 0, 0, 0
        for i, (h, w) in enumerate(shapes):
            grown_h, grown_w = max(tall, h + 1), max(wide, w + 1)
            if i > start and (i - start + 1) * 3 * grown_h * grown_w * 5 > self.max_padded_bytes:
                chunks.append((start, i))
                start, grown_h, grown_w = i, h + 1, w + 1
            tall, wide = grown_h, grown_w
        if shapes:
            chunks.append((start, len(shapes)))
        return chunks

    def _resample(
        self,
        pixels: torch.Tensor,
        shapes: Sequence[tuple[int, int]],
        boxes: np.ndarray,
        start: int,
        stop: int,
    ) -> torch.Tensor:
        """One ``roi_align`` of images ``start:stop``, padded into one tensor,
        over their boxes."""
        padded = _padded(pixels, shapes, start, stop, self.device)
        x, y, w, h = (boxes[start:stop, i] for i in range(4))
        index = np.arange(stop - start, dtype=np.float32)
        rois = torch.from_numpy(np.stack([index, x, y, x + w, y + h], axis=1)).to(self.device)
        return roi_align(padded, rois, output_size=self.size, sampling_ratio=0, aligned=True)

    def decode_ahead(
        self, batches: Iterable[Mapping[str, Any]], *, field: str = "jpg", depth: int = 2
    ) -> DecodeAhead:
        """The batches of ``batches`` (a ``DataLoader``, say), each with
        ``field`` decoded, ahead of the caller (``DecodeAhead``). A thread
        takes batches from ``batches`` and decodes their JPEGs, then crops,
        resizes and flips them (a few launches per batch, their offsets
        worked out on the CPU), on a CUDA stream of its own: nvJPEG's
        batched decode waits for its batch on the CPU, which in the training
        loop would hold up the launches of the next step, and the thread's
        work runs while the caller trains. Up to ``depth`` decoded batches
        wait for the caller, and the thread works on one more. Each batch
        comes as a ``dict``: its fields, ``field`` the images on ``device``
        (ready for the caller's current stream), and ``<field>_offsets``
        left out."""
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(
                f"invalid decode_ahead parameter depth: an int of at least 1, got {depth!r}"
            )
        return DecodeAhead(self, batches, field, depth)


class _Decoded(NamedTuple):
    """A batch's images decoded: their pixels one after the other (each
    ``(3, h, w)``), then zeros; and each image's ``(h, w)``."""

    pixels: torch.Tensor
    shapes: list[tuple[int, int]]


def _inputs(batch: Mapping[str, Any], field: str) -> tuple[list[torch.Tensor], np.ndarray]:
    """The batch's JPEGs and their boxes (float32 ``(B, 5)``), checked."""
    if f"{field}_box" not in batch:
        raise KeyError(
            f"the batch has no field {field}_box: decode the field {field!r} with "
            "decoder.boxes (and give the dataset a batch_size)"
        )
    jpegs = _members(batch, field)
    boxes = np.asarray(batch[f"{field}_box"], dtype=np.float32)
    if boxes.ndim != 2 or boxes.shape != (len(jpegs), 5):
        raise ValueError(f"{field}_box has shape {tuple(boxes.shape)}, expected ({len(jpegs)}, 5)")
    return jpegs, boxes


# How long the thread of ``decode_ahead`` waits at a time for room in its
# queue before it looks again whether it should stop, and how long closing
# waits for it to end.
_POLL_SECONDS = 0.1
_CLOSE_SECONDS = 60.0


class DecodeAhead:
    """The iterator ``BatchImageDecoder.decode_ahead`` returns: the batches
    of a loader with their JPEGs decoded by a thread, ahead of the caller.

    The loader belongs to the thread until the iterator ends or is closed;
    an error met there (reading or decoding) is raised by ``next()`` at the
    batch it concerns. ``close()``, or dropping the iterator, stops the
    thread after the batch it is on.

    The thread takes batches before the loop does, so a loader's own
    ``state_dict()`` counts batches the loop has not had yet: checkpoint
    with this iterator's ``state_dict()`` instead."""

    def __init__(
        self, decoder: BatchImageDecoder, batches: Iterable[Any], field: str, depth: int
    ) -> None:
        self._state: dict[str, Any] | None = None
        self._started = False
        self._ended = False
        self._feeder = _Feeder(decoder, batches, field, depth)

    def __iter__(self) -> DecodeAhead:
        return self

    def __next__(self) -> dict[str, Any]:
        feeder = self._feeder
        if not self._started and not self._ended:
            feeder.thread.start()
            self._started = True
        while True:
            if self._ended:
                raise StopIteration
            try:
                kind, value = feeder.queue.get(timeout=_POLL_SECONDS)
                break
            except queue.Empty:
                # Closed from elsewhere, or the thread gone: nothing more comes.
                if self._ended or (not feeder.thread.is_alive() and feeder.queue.empty()):
                    self._ended = True
        if kind == "batch":
            out, ready, self._state = value
            return feeder.handed(out, ready)
        self.close()
        if kind == "error":
            if isinstance(value, StopIteration):
                # Raised as it is, it would end the caller's loop quietly.
                raise RuntimeError(f"decode_ahead's thread raised {value!r}") from value
            raise value
        raise StopIteration

    def close(self) -> None:
        """Stops the thread after the batch it is on (waiting for it at
        most a minute); later ``next()`` calls raise ``StopIteration``."""
        self._ended = True
        feeder = getattr(self, "_feeder", None)
        if feeder is None:
            return
        feeder.stop.set()
        if self._started and threading.current_thread() is not feeder.thread:
            feeder.thread.join(timeout=_CLOSE_SECONDS)

    def __del__(self) -> None:
        # Only tells the thread to stop: a join here could run in any thread
        # the garbage collector runs in (the thread's own, or one it waits
        # for), or at the interpreter's exit.
        feeder = getattr(self, "_feeder", None)
        if feeder is not None:
            feeder.stop.set()

    def state_dict(self) -> dict[str, Any] | None:
        """The loader's ``state_dict()`` as of the last batch this iterator
        handed out (taken by the thread right after it took that batch):
        loaded into a new loader, it resumes with the batch after it. None
        when the loader has no ``state_dict`` or before the first batch."""
        return self._state


class _Feeder:
    """The thread behind ``DecodeAhead`` and its queue (kept apart, so that
    the thread does not keep the iterator alive)."""

    #: The feeders whose thread may run: stopped and waited for at the
    #: interpreter's exit, so that no thread is inside a torch call while
    #: the process tears down what it uses.
    live: ClassVar[weakref.WeakSet[_Feeder]] = weakref.WeakSet()

    def __init__(
        self, decoder: BatchImageDecoder, batches: Iterable[Any], field: str, depth: int
    ) -> None:
        self.decoder = decoder
        # A StatefulDataLoader's state is taken in the thread, after each
        # batch it takes (the loader is the thread's until the end).
        self.state_of = getattr(batches, "state_dict", None)
        self.source = iter(batches)
        self.field = field
        self.queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        on_cuda = decoder.device.type == "cuda"
        self.stream = torch.cuda.Stream(decoder.device) if on_cuda else None
        self.thread = threading.Thread(
            target=self._run, name="shardstream-decode-ahead", daemon=True
        )
        _Feeder.live.add(self)

    def _on_stream(self) -> contextlib.AbstractContextManager[Any]:
        """The thread's CUDA stream made current (nothing on another device)."""
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def _put(self, item: tuple[str, Any]) -> bool:
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
                    self._put(("end", None))
                    return
                state = self.state_of() if self.state_of is not None else None
                jpegs, boxes = _inputs(batch, self.field)
                with self._on_stream():
                    decoded = self.decoder._decode(jpegs)
                out, ready = self._augmented(batch, decoded, boxes)
                if not self._put(("batch", (out, ready, state))):
                    return
        except BaseException as error:  # raised again in the caller
            self._put(("error", error))

    def _augmented(self, batch: Mapping[str, Any], decoded: _Decoded, boxes: np.ndarray) -> Any:
        """Launches the batch's crops, resizes and flips on the thread's
        stream (after its decode there); the batch and when it is ready."""
        out = {k: v for k, v in batch.items() if k != f"{self.field}_offsets"}
        with self._on_stream():
            out[self.field] = self.decoder._augment(decoded, boxes)
            if self.stream is None:
                return out, None
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return out, ready

    def handed(self, out: dict[str, Any], ready: Any) -> dict[str, Any]:
        """The batch, once the caller's current stream waits for it."""
        if ready is not None:
            current = torch.cuda.current_stream(self.decoder.device)
            current.wait_event(ready)
            # The images were made on the thread's stream: the allocator
            # must not hand their memory out again before the caller's
            # stream is done with them.
            out[self.field].record_stream(current)
        return out


@atexit.register
def _stop_feeders() -> None:
    """Stops every ``decode_ahead`` thread still running and waits for it
    (a minute at most each): a daemon thread still inside a torch call when
    the interpreter finalises can abort the process."""
    feeders = list(_Feeder.live)
    for feeder in feeders:
        feeder.stop.set()
    for feeder in feeders:
        if feeder.thread.is_alive() and threading.current_thread() is not feeder.thread:
            feeder.thread.join(timeout=_CLOSE_SECONDS)


def _padded(
    pixels: torch.Tensor,
    shapes: Sequence[tuple[int, int]],
    start: int,
    stop: int,
    device: torch.device,
) -> torch.Tensor:
    """Images ``start:stop`` of ``pixels`` (as ``_Decoded`` holds them) in
    one float32 ``(n, 3, H + 1, W + 1)`` tensor for ``roi_align``: each
    image's rows and columns, then its last row and column repeated once
    (so that bilinear sampling at its edge reads the edge); what lies
    further right is whatever followed in the batch's pixels, which no box
    inside its image reaches. A copy of row windows and an edge fix,
    whatever the number of images; the offsets are worked out on the CPU
    and sent in one copy."""
    sizes = np.array(shapes, dtype=np.int64).reshape(-1, 2)
    heights, widths = sizes[:, 0], sizes[:, 1]
    plane = heights * widths
    starts = np.cumsum(3 * plane) - 3 * plane
    heights, widths, plane, starts = (a[start:stop] for a in (heights, widths, plane, starts))
    count = stop - start
    tall, wide = int(heights.max()) + 1, int(widths.max()) + 1
    # Where each padded row starts in `pixels`: its image's channel plane,
    # then its row (the last one again below the image).
    rows = (
        starts[:, None, None]
        + np.arange(3)[None, :, None] * plane[:, None, None]
        + np.minimum(np.arange(tall)[None, None, :], heights[:, None, None] - 1)
        * widths[:, None, None]
    ).reshape(-1)
    # Column w of each padded row (in the padded tensor), and column w - 1.
    edges = np.arange(count * 3 * tall) * wide + np.repeat(widths, 3 * tall)
    offsets = torch.from_numpy(np.concatenate([rows, edges, edges - 1])).to(device)
    rows_at, edge_at, inner_at = torch.split(offsets, [len(rows), len(edges), len(edges)])
    padded = pixels.unfold(0, wide, 1).index_select(0, rows_at)
    cells = padded.view(-1)
    cells[edge_at] = cells[inner_at]
    return padded.view(count, 3, tall, wide).float()


def _members(batch: Mapping[str, Any], field: str) -> list[torch.Tensor]:
    """The batch's JPEGs as uint8 CPU tensors (views of one packed buffer)."""
    data = batch[field]
    offsets = batch.get(f"{field}_offsets")
    if offsets is not None:
        buffer = torch.as_tensor(data)
        bounds = torch.as_tensor(offsets).tolist()
        sizes = [b - a for a, b in itertools.pairwise(bounds)]
        # One call makes every view (the offsets start at 0 and end at the
        # buffer's end: the packed layout).
        return list(torch.split(buffer[bounds[0] : bounds[-1]], sizes))
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = [data]
    return [torch.frombuffer(bytearray(member), dtype=torch.uint8) for member in data]

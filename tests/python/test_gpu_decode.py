"""``ImageBoxes`` and ``shardstream.gpu.BatchImageDecoder``, run on the CPU:
the workers draw each JPEG's box and flip as ``Image`` does, and the batched
decode (``decode_jpeg`` on a list, one ``roi_align``, one flip) gives the
images ``Image`` gives, up to resampling."""

from __future__ import annotations

import gc
import io
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from _shardtest import write_tar
from PIL import Image as PILImage

from shardstream import FieldDecodeError, Image, ImageBoxes, StateMismatchError, StreamingDataset
from shardstream.gpu import BatchImageDecoder

SIZES = [(120, 160), (150, 200), (131, 97), (64, 64), (300, 90), (77, 240)]


def gradient_jpeg(height: int, width: int, fmt: str = "JPEG") -> bytes:
    """Red grows left to right, green top to bottom: where a pixel came
    from shows in its colour (4:4:4, quality 98, so the codec adds little)."""
    x = np.linspace(0, 255, width)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height)[:, None].repeat(width, 1)
    rgb = np.stack([x, y, np.full_like(x, 128)], axis=-1).round().astype(np.uint8)
    out = io.BytesIO()
    options = {"quality": 98, "subsampling": 0} if fmt == "JPEG" else {}
    PILImage.fromarray(rgb).save(out, format=fmt, **options)
    return out.getvalue()


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("gpu")
    for shard in range(2):
        members = []
        for i in range(12):
            h, w = SIZES[(shard * 12 + i) % len(SIZES)]
            members.append((f"s{shard}-{i:02d}.jpg", gradient_jpeg(h, w)))
            members.append((f"s{shard}-{i:02d}.cls", str(i).encode()))
        write_tar(root / f"part-{shard}.tar", members)
    return str(root / "part-{0..1}.tar")


def by_key(batches, images_of) -> dict[str, np.ndarray]:
    out = {}
    for batch in batches:
        for key, image in zip(batch["__key__"], images_of(batch), strict=True):
            out[key] = np.asarray(image)
    return out


@pytest.mark.parametrize(
    ("image", "pack_bytes"),
    [
        (Image(48, flip=0.5), True),
        (Image((40, 56), scale=(0.3, 1.0), flip=0.5, layout="HWC"), False),
        (Image(32, crop="center"), True),
        (Image((24, 36), crop="resize"), True),
    ],
)
def test_the_batched_decode_gives_images_boxes_and_flips(shards, image, pack_bytes):
    """Every image: the same box and flip as ``Image`` (a wrong box or flip
    moves the gradient by tens of levels), pixels within resampling's
    difference."""
    common = {"seed": 7, "batch_size": 5, "shuffle_buffer": 6}
    expected = by_key(StreamingDataset(shards, decode={"jpg": image}, **common), lambda b: b["jpg"])
    decoder = BatchImageDecoder(image, device="cpu")
    ds = StreamingDataset(shards, decode={"jpg": decoder.boxes}, pack_bytes=pack_bytes, **common)
    batches = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
    for batch in batches:
        assert batch["jpg_box"].dtype == torch.float32 and batch["jpg_box"].shape[1] == 5
    got = by_key(batches, decoder)
    assert sorted(got) == sorted(expected) and len(got) == 24
    flips = 0
    for key, want in expected.items():
        have = got[key]
        assert have.dtype == np.uint8 and have.shape == want.shape, key
        diff = np.abs(have.astype(int) - want.astype(int))
        assert diff.mean() < 1.0 and diff.max() <= 8, (key, diff.mean(), diff.max())
        red = want[0] if image.layout == "CHW" else want[..., 0]
        flips += int(red[:, 0].mean() > red[:, -1].mean())
    if image.flip:
        assert 0 < flips < len(expected)


def test_float_output_and_small_chunks_give_the_same_images(shards):
    image = Image(40, flip=0.5)
    whole = BatchImageDecoder(image, device="cpu")
    chunked = BatchImageDecoder(image, device="cpu", dtype=torch.float32, max_padded_bytes=1)
    ds = StreamingDataset(shards, decode={"jpg": whole.boxes}, batch_size=6, pack_bytes=True)
    for batch in ds:
        a, b = whole(batch), chunked(batch)
        assert b.dtype == torch.float32 and a.shape == b.shape == (6, 3, 40, 40)
        assert torch.equal(a, b.round().clamp(0, 255).to(torch.uint8))


def test_boxes_are_the_samples_own_in_every_epoch_and_at_resume(shards):
    boxes = ImageBoxes(Image(32, flip=0.5))
    ds = StreamingDataset(shards, decode={"jpg": boxes}, seed=3, shuffle_buffer=4)

    def epoch(dataset):
        return {s["__key__"]: s["jpg_box"].tolist() for s in dataset}

    first = epoch(ds)
    ds.set_epoch(1)
    assert epoch(ds) != first
    resumed = StreamingDataset(shards, decode={"jpg": boxes}, seed=3, shuffle_buffer=4)
    iterator = iter(resumed)
    seen = {s["__key__"]: s["jpg_box"].tolist() for s in (next(iterator) for _ in range(7))}
    state = resumed.state_dict()
    rest = StreamingDataset(shards, decode={"jpg": boxes}, seed=3, shuffle_buffer=4)
    rest.load_state_dict(state)
    seen.update(epoch(rest))
    assert seen == first
    for key, (x, y, w, h, flip) in first.items():
        assert x >= 0 and y >= 0 and w > 0 and h > 0 and flip in (0.0, 1.0), key


def test_pngs_and_boxes_that_would_pad_are_refused(tmp_path):
    write_tar(tmp_path / "png.tar", [("a.png", gradient_jpeg(20, 30, fmt="PNG"))])
    ds = StreamingDataset(str(tmp_path / "png.tar"), decode={"png": ImageBoxes(Image(16))})
    with pytest.raises(FieldDecodeError, match="ImageBoxes takes JPEGs only"):
        list(ds)
    with pytest.raises(
        ValueError, match="invalid Image parameter crop: ImageBoxes needs an output"
    ):
        ImageBoxes(Image(crop=None))
    with pytest.raises(
        ValueError, match=r"invalid Image parameter resize: .*below the output side"
    ):
        ImageBoxes(Image(64, crop="center", resize=48))
    with pytest.raises(TypeError, match="invalid ImageBoxes parameter image"):
        ImageBoxes("jpg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype"):
        BatchImageDecoder(Image(16), device="cpu", dtype=torch.int32)
    with pytest.raises(KeyError, match="jpg_box"):
        BatchImageDecoder(Image(16), device="cpu")({"jpg": [b""]})


def test_it_pickles_and_names_its_image():
    boxes = ImageBoxes(Image(32, flip=0.25))
    assert pickle.loads(pickle.dumps(boxes)) == boxes
    assert boxes.image == Image(32, flip=0.25)
    assert repr(boxes).startswith("ImageBoxes(Image(size=(32, 32)")
    assert boxes != ImageBoxes(Image(32))


def test_the_state_tells_boxes_from_decoded_images(shards, tmp_path: Path):
    image = Image(32)
    ds = StreamingDataset(shards, decode={"jpg": ImageBoxes(image)})
    iterator = iter(ds)
    next(iterator)
    other = StreamingDataset(shards, decode={"jpg": image})
    other.load_state_dict(ds.state_dict())
    with pytest.raises(StateMismatchError, match=r"saved for other options \(decode differs\)"):
        next(iter(other))


def test_decode_ahead_gives_each_batch_decoded_in_order(shards):
    """The thread's batches are the decoder's own, in the loader's order,
    with the other fields kept and the offsets left out."""
    decoder = BatchImageDecoder(Image(40, flip=0.5), device="cpu")
    ds = StreamingDataset(
        shards, decode={"jpg": decoder.boxes, "cls": "int"}, batch_size=5, pack_bytes=True, seed=2
    )
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    ds.set_epoch(0)
    expected = [(b["__key__"], decoder(b), b["cls"]) for b in loader]
    ds.set_epoch(0)
    got = list(decoder.decode_ahead(loader, depth=1))
    assert len(got) == len(expected) >= 5
    for batch, (keys, images, labels) in zip(got, expected, strict=True):
        assert batch["__key__"] == keys and torch.equal(batch["cls"], labels)
        assert torch.equal(batch["jpg"], images) and "jpg_offsets" not in batch
        assert batch["jpg_box"].shape == (len(keys), 5)


def test_decode_ahead_raises_the_threads_error_and_stops_when_closed(shards):
    decoder = BatchImageDecoder(Image(16), device="cpu")
    good = {"jpg": [gradient_jpeg(20, 30)], "jpg_box": torch.tensor([[0, 0, 30, 20, 0]])}
    ahead = decoder.decode_ahead(iter([good, {"jpg": [b""]}, good]))
    assert next(ahead)["jpg"].shape == (1, 3, 16, 16)
    with pytest.raises(KeyError, match="jpg_box"):
        next(ahead)

    taken = []

    def endless():
        while len(taken) < 1000:
            taken.append(1)
            yield good

    ahead = decoder.decode_ahead(endless(), depth=2)
    next(ahead)
    threads = [t for t in threading.enumerate() if t.name == "shardstream-decode-ahead"]
    assert len(threads) == 1
    ahead.close()
    assert not threads[0].is_alive()
    # One batch handed out, two queued, one more taken while the queue was full.
    assert len(taken) <= 4
    for depth in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="invalid decode_ahead parameter depth"):
            decoder.decode_ahead([], depth=depth)  # type: ignore[arg-type]


def test_the_padded_batch_repeats_each_images_last_row_and_column():
    """What ``roi_align`` may read of each image: its pixels, its last row
    below them and its last column beside them, in one tensor."""
    from shardstream.gpu import _padded

    sizes = [(5, 7), (9, 3), (4, 4), (9, 7)]
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8) for h, w in sizes]
    pixels = torch.cat([image.reshape(-1) for image in images] + [torch.zeros(8)]).float()
    padded = _padded(
        pixels, [tuple(image.shape[1:]) for image in images], 0, 4, torch.device("cpu")
    )
    assert padded.shape == (4, 3, 10, 8) and padded.dtype == torch.float32
    for i, image in enumerate(images):
        h, w = image.shape[1:]
        edged = torch.nn.functional.pad(image[None].float(), (0, 1, 0, 1), mode="replicate")[0]
        assert torch.equal(padded[i, :, : h + 1, : w + 1], edged), i
        assert torch.equal(padded[i, :, h:, : w + 1], edged[:, -1:].expand(3, 10 - h, w + 1)), i


@pytest.mark.parametrize("workers", [0, 2])
def test_decode_ahead_checkpoints_the_batch_it_handed_out(shards, workers):
    """The thread takes batches before the loop: ``state_dict()`` of the
    iterator (not of the loader) resumes with the batch after the last one
    the loop had, so every sample comes once."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    decoder = BatchImageDecoder(Image(24, flip=0.5), device="cpu")

    def loader():
        ds = StreamingDataset(
            shards, decode={"jpg": decoder.boxes}, batch_size=3, pack_bytes=True, seed=4
        )
        return StatefulDataLoader(ds, batch_size=None, num_workers=workers)

    whole = [b["__key__"] for b in decoder.decode_ahead(loader())]
    ahead = decoder.decode_ahead(loader(), depth=2)
    assert ahead.state_dict() is None
    taken = [next(ahead)["__key__"] for _ in range(3)]
    state = ahead.state_dict()
    ahead.close()
    with pytest.raises(StopIteration):
        next(ahead)
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [b["__key__"] for b in decoder.decode_ahead(resumed)]
    assert taken + rest == whole
    assert sorted(k for keys in whole for k in keys) == sorted(
        f"s{s}-{i:02d}" for s in range(2) for i in range(12)
    )


def test_decode_ahead_ends_when_closed_from_elsewhere_and_names_a_stray_stopiteration():
    decoder = BatchImageDecoder(Image(16), device="cpu")
    gate = threading.Event()

    def slow():
        # Holds the thread in `next(loader)` until the test ends (bounded).
        gate.wait(timeout=30)
        yield from ()

    ahead = decoder.decode_ahead(slow())
    closer = threading.Timer(0.3, ahead.close)
    closer.start()
    try:
        with pytest.raises(StopIteration):
            next(ahead)
    finally:
        gate.set()
        closer.join(timeout=30)

    class Odd(dict):
        """A batch whose field access raises StopIteration."""

        def __getitem__(self, key):
            raise StopIteration

    odd = Odd(jpg=b"", jpg_box=None)
    with pytest.raises(RuntimeError, match="decode_ahead's thread raised StopIteration"):
        next(decoder.decode_ahead([odd]))


def test_decode_ahead_of_no_iterable_raises_and_reports_nothing_later():
    reported = []
    hook, sys.unraisablehook = sys.unraisablehook, reported.append
    try:
        with pytest.raises(TypeError):
            BatchImageDecoder(Image(16), device="cpu").decode_ahead(5)  # type: ignore[arg-type]
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert reported == []


def test_a_process_leaving_decode_ahead_running_exits_cleanly(shards):
    """The thread is stopped and waited for at the interpreter's exit: one
    still inside a torch call while the process tears down can abort it."""
    script = f"""
import itertools, torch
from shardstream import Image, StreamingDataset
from shardstream.gpu import BatchImageDecoder
decoder = BatchImageDecoder(Image(64, flip=0.5), device="cpu")
ds = StreamingDataset({shards!r}, decode={{"jpg": decoder.boxes}}, batch_size=4, pack_bytes=True)
batch = next(iter(ds))
ahead = decoder.decode_ahead(itertools.repeat(batch, 10_000))
next(ahead)
print("left running")
"""
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0 and "left running" in done.stdout, done.stderr[-2000:]

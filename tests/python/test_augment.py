"""``shardstream.Image``: JPEG and PNG fields decoded, cropped, resized and
flipped in Rust to fixed-shape uint8 arrays and batches; the same pixels for
a sample whatever the workers, the resume or the layout; close to
torchvision on the same image; parameters checked at construction."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from _shardtest import collect, loader, slot_states, write_tar
from PIL import Image as PILImage
from torchdata.stateful_dataloader import StatefulDataLoader

import shardstream
from shardstream import Image, StreamingDataset

SHARDS, PER_SHARD = 3, 10


def as_is(item):
    """DataLoader's per-item hook that keeps items as they are."""
    return item


def photo(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A smooth picture with some noise, like a photo."""
    y, x = np.mgrid[0:height, 0:width]
    phases = rng.uniform(0, 6.28, 3)
    channels = [127 + 100 * np.sin(x / (9 + 4 * i) + y / 13 + p) for i, p in enumerate(phases)]
    noise = rng.integers(0, 16, (height, width, 3))
    return (np.stack(channels, -1) + noise).clip(0, 255).astype(np.uint8)


def encoded(pixels: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    image = PILImage.fromarray(pixels)
    image.save(buf, fmt, quality=90) if fmt == "JPEG" else image.save(buf, fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> str:
    """Three shards of JPEGs of a few sizes (and a class), as a brace spec."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(1)
    for shard in range(SHARDS):
        members = []
        for i in range(PER_SHARD):
            height, width = [(90, 120), (120, 90), (75, 100)][i % 3]
            key = f"s{shard}-{i:02d}"
            members.append((f"{key}.jpg", encoded(photo(rng, height, width), "JPEG")))
            members.append((f"{key}.cls", str(i).encode()))
        write_tar(root / f"part-{shard}.tar", members)
    return str(root / "part-{0..2}.tar")


def by_key(samples, field="jpg") -> dict[str, np.ndarray]:
    out = {}
    for sample in samples:
        if isinstance(sample["__key__"], list):
            for key, pixels in zip(sample["__key__"], sample[field], strict=True):
                out[key] = np.array(pixels)
        else:
            out[sample["__key__"]] = np.array(sample[field])
    return out


def dataset(spec: str, **kwargs) -> StreamingDataset:
    options = {"seed": 4, "shuffle_buffer": 6, "decode": {"jpg": Image(32, flip=0.5)}}
    options.update(kwargs)
    return StreamingDataset(spec, **options)


@pytest.mark.parametrize("layout", ["CHW", "HWC"])
def test_batches_are_fixed_shape_uint8(images, layout):
    transform = Image((24, 40), crop="random_resized", flip=0.5, layout=layout)
    ds = dataset(images, decode={"jpg": transform, "cls": "int"}, batch_size=8)
    batches = collect(loader(ds, 2, collate_fn=as_is))
    shape = (3, 24, 40) if layout == "CHW" else (24, 40, 3)
    assert sum(len(b["__key__"]) for b in batches) == SHARDS * PER_SHARD
    for batch in batches:
        array = batch["jpg"]
        assert isinstance(array, np.ndarray) and array.dtype == np.uint8
        assert array.shape == (len(batch["__key__"]), *shape)
        assert array.flags["C_CONTIGUOUS"]
        assert array.std() > 5  # a picture, not zeros


@pytest.mark.parametrize("crop", ["center", "resize", None])
def test_every_crop_gives_its_shape_for_png_too(tmp_path, crop):
    rng = np.random.default_rng(2)
    pixels = photo(rng, 50, 70)
    path = write_tar(tmp_path / "png.tar", [("a.png", encoded(pixels, "PNG"))])
    size = None if crop is None else 30
    (sample,) = collect(
        StreamingDataset(str(path), decode={"png": Image(size, crop=crop, layout="HWC")})
    )
    assert sample["png"].shape == ((50, 70, 3) if crop is None else (30, 30, 3))
    if crop is None:
        np.testing.assert_array_equal(sample["png"], pixels)


def test_same_seed_and_epoch_same_pixels_whatever_the_workers(images):
    alone = by_key(collect(dataset(images)))
    assert len(alone) == SHARDS * PER_SHARD
    for workers in (1, 2):
        got = by_key(collect(loader(dataset(images), workers, collate_fn=as_is)))
        assert got.keys() == alone.keys()
        for key, pixels in alone.items():
            np.testing.assert_array_equal(got[key], pixels, err_msg=key)
    # Another shuffle buffer and shard order change the order, not the pixels.
    other_order = by_key(collect(dataset(images, shuffle_buffer=0, shuffle_shards=False)))
    assert all(np.array_equal(other_order[k], v) for k, v in alone.items())


def test_another_epoch_or_seed_draws_other_crops(images):
    first = by_key(collect(dataset(images)))
    ds = dataset(images)
    ds.set_epoch(1)
    second = by_key(collect(ds))
    other_seed = by_key(collect(dataset(images, seed=5)))
    for other in (second, other_seed):
        same = sum(np.array_equal(first[k], other[k]) for k in first)
        assert same <= 2, same


def resumable(spec: str) -> StatefulDataLoader:
    ds = dataset(spec, decode={"jpg": Image(32, flip=0.5), "cls": "int"}, shuffle_buffer=5)
    return StatefulDataLoader(ds, batch_size=4, num_workers=2, collate_fn=as_is, timeout=120)


def flat(batches) -> list[tuple[str, bytes]]:
    return [(s["__key__"], np.asarray(s["jpg"]).tobytes()) for batch in batches for s in batch]


def test_exact_resume_with_two_workers_and_random_crops(images):
    full = flat(collect(resumable(images)))
    assert len(full) == SHARDS * PER_SHARD
    first = resumable(images)
    iterator = iter(first)
    prefix = [next(iterator) for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))
    assert slot_states(state)
    del iterator, first
    resumed = resumable(images)
    resumed.load_state_dict(state)
    assert flat(prefix) + flat(collect(resumed)) == full


def test_elastic_resume_keeps_each_samples_pixels(images):
    reference = by_key(collect(dataset(images)))
    states, seen = [], {}
    for rank in range(2):
        ds = dataset(images, rank=rank, world_size=2, num_workers=1, worker_id=0)
        iterator = iter(ds)
        for _ in range(4):
            sample = next(iterator)
            seen[sample["__key__"]] = np.array(sample["jpg"])
        states.append(json.loads(json.dumps(ds.state_dict())))
        del iterator
    elastic = shardstream.elastic_state(states)
    resumed = dataset(images, rank=0, world_size=1, num_workers=1, worker_id=0)
    resumed.load_state_dict(elastic)
    rest = by_key(collect(resumed))
    assert len(seen) + len(rest) == len(reference) and not seen.keys() & rest.keys()
    for key, pixels in {**seen, **rest}.items():
        np.testing.assert_array_equal(pixels, reference[key], err_msg=key)


def test_resume_with_other_transform_parameters_is_refused(images):
    ds = dataset(images)
    iterator = iter(ds)
    next(iterator)
    state = ds.state_dict()
    del iterator
    other = dataset(images, decode={"jpg": Image(32, flip=0.25)})
    with pytest.raises(shardstream.StateMismatchError):
        other.load_state_dict(state)
        collect(other)


def torchvision_center(pixels: np.ndarray, size: int) -> np.ndarray:
    from torchvision import transforms

    resize, crop = transforms.Resize(int(size / 0.875)), transforms.CenterCrop(size)
    pipeline = transforms.Compose([resize, crop])
    return np.asarray(pipeline(PILImage.fromarray(pixels)))


@pytest.mark.parametrize(("height", "width"), [(375, 500), (500, 333), (750, 1000)])
def test_center_crop_is_close_to_torchvision(tmp_path, height, width):
    """Same PNG pixels: within 1 level everywhere (the filter is Pillow's,
    computed with other rounding). Same JPEG decoded by PIL and by us, both
    with libjpeg-turbo: the same, within 1 level everywhere, at full scale;
    at 1/2 scale (the large image, which PIL decodes whole) within 1.5
    levels on average."""
    rng = np.random.default_rng(height)
    pixels = photo(rng, height, width)
    png, jpeg = encoded(pixels, "PNG"), encoded(pixels, "JPEG")
    path = write_tar(tmp_path / "one.tar", [("a.png", png), ("a.jpg", jpeg)])
    transform = Image(224, crop="center", layout="HWC")
    (sample,) = collect(StreamingDataset(str(path), decode={"png": transform, "jpg": transform}))
    expected = torchvision_center(pixels, 224)
    assert sample["png"].shape == expected.shape == (224, 224, 3)
    png_diff = np.abs(sample["png"].astype(int) - expected.astype(int))
    assert png_diff.max() <= 1, png_diff.max()
    decoded = np.asarray(PILImage.open(io.BytesIO(jpeg)).convert("RGB"))
    jpeg_diff = np.abs(sample["jpg"].astype(int) - torchvision_center(decoded, 224).astype(int))
    if width < 1000:
        assert jpeg_diff.max() <= 1, jpeg_diff.max()
    assert jpeg_diff.mean() <= 1.5, jpeg_diff.mean()


@pytest.mark.parametrize(
    ("mode", "options"),
    [
        ("RGB", {"subsampling": 0}),
        ("RGB", {"subsampling": 1}),
        ("RGB", {"subsampling": 2}),
        ("RGB", {"progressive": True}),
        ("RGB", {"restart_marker_blocks": 3}),
        ("L", {}),
        ("CMYK", {}),
    ],
)
def test_jpegs_decode_to_the_pixels_pil_gives(tmp_path, mode, options):
    """Every kind of JPEG (chroma subsampling 4:4:4, 4:2:2, 4:2:0,
    progressive, restart markers, gray, CMYK) gives PIL's pixels exactly,
    through `Image` and the `rgb8` decoder alike: both decode with
    libjpeg-turbo's defaults, CMYK turned into RGB as PIL does. A crop's
    region decode is checked against the whole decode in Rust."""
    pixels = photo(np.random.default_rng(7), 101, 77)
    buffer = io.BytesIO()
    PILImage.fromarray(pixels).convert(mode).save(buffer, "JPEG", quality=90, **options)
    jpeg = buffer.getvalue()
    path = write_tar(tmp_path / "one.tar", [("a.jpg", jpeg)])
    expected = np.asarray(PILImage.open(io.BytesIO(jpeg)).convert("RGB"))
    for decoder in (Image(crop=None, layout="HWC"), "rgb8"):
        (sample,) = collect(StreamingDataset(str(path), decode={"jpg": decoder}))
        assert sample["jpg"].shape == expected.shape == (101, 77, 3)
        diff = np.abs(sample["jpg"].astype(int) - expected.astype(int))
        assert diff.max() == 0, (decoder, diff.max())


@pytest.mark.parametrize("decoder", [Image(crop=None, layout="HWC"), "rgb8"])
def test_a_jpeg_without_a_frame_after_a_good_one_is_an_error(tmp_path, decoder):
    """Garbage after a JPEG's first marker (a datastream of tables only)
    decoded after a good JPEG is a FieldDecodeError naming the sample, not
    an image of the good one's size (it came out all zeros through a
    decoder handle reused from the good image)."""
    buffer = io.BytesIO()
    PILImage.fromarray(np.full((24, 40, 3), 100, np.uint8)).save(buffer, "JPEG")
    good = buffer.getvalue()
    garbage = good[:4] + b"\x5a" * 200
    path = write_tar(tmp_path / "two.tar", [("a.jpg", good), ("b.jpg", garbage)])
    dataset = StreamingDataset(
        str(path), shuffle_buffer=0, shuffle_shards=False, decode={"jpg": decoder}, decode_threads=1
    )
    with pytest.raises(shardstream.FieldDecodeError, match='sample "b"'):
        collect(dataset)


def test_flip_one_mirrors_the_image(tmp_path):
    pixels = photo(np.random.default_rng(3), 20, 30)
    path = write_tar(tmp_path / "one.tar", [("a.png", encoded(pixels, "PNG"))])
    (sample,) = collect(
        StreamingDataset(str(path), decode={"png": Image(crop=None, flip=1.0, layout="CHW")})
    )
    np.testing.assert_array_equal(sample["png"], pixels[:, ::-1].transpose(2, 0, 1))


def test_corrupt_image_names_shard_key_and_field(tmp_path):
    good = encoded(photo(np.random.default_rng(4), 40, 40), "JPEG")
    path = write_tar(
        tmp_path / "bad.tar", [("a.jpg", good), ("b.jpg", good[:-20]), ("c.jpg", good)]
    )
    ds = StreamingDataset(str(path), decode={"jpg": Image(16)}, shuffle_buffer=0)
    bad = r'bad\.tar.*field "jpg".*"b".*truncated'
    with pytest.raises(shardstream.FieldDecodeError, match=bad):
        collect(loader(ds, 1, collate_fn=as_is))
    for junk in (
        b"",
        good[: len(good) // 2],
        b"\xff\xd8\xff" + bytes(50),
        b"\x89PNG\r\n\x1a\n" + bytes(40),
        b"GIF89a",
    ):
        path = write_tar(tmp_path / "junk.tar", [("a.jpg", junk)])
        with pytest.raises(shardstream.FieldDecodeError, match=r'junk\.tar.*field "jpg"'):
            collect(StreamingDataset(str(path), decode={"jpg": Image(16)}))


@pytest.mark.parametrize(
    ("kwargs", "error", "parameter"),
    [
        ({"size": 0}, ValueError, "size"),
        ({"size": (224, 0)}, ValueError, "size"),
        ({"size": 16385}, ValueError, "size"),
        ({"size": (16384, 16384)}, ValueError, "size"),
        ({"size": "224"}, TypeError, "size"),
        ({"size": (1, 2, 3)}, TypeError, "size"),
        ({"size": True}, TypeError, "size"),
        ({}, ValueError, "size"),
        ({"size": 224, "crop": None}, ValueError, "size"),
        ({"size": 224, "crop": "random"}, ValueError, "crop"),
        ({"size": 224, "scale": (0.5, 0.1)}, ValueError, "scale"),
        ({"size": 224, "scale": (0.0, 1.0)}, ValueError, "scale"),
        ({"size": 224, "scale": 0.5}, TypeError, "scale"),
        ({"size": 224, "ratio": (2.0, 1.0)}, ValueError, "ratio"),
        ({"size": 224, "ratio": (float("nan"), 1.0)}, ValueError, "ratio"),
        ({"size": 224, "crop": "center", "scale": (0.1, 1.0)}, ValueError, "scale"),
        ({"size": 224, "resize": 256}, ValueError, "resize"),
        ({"size": 224, "crop": "center", "resize": 0}, ValueError, "resize"),
        ({"size": 224, "crop": "center", "resize": 2.5}, TypeError, "resize"),
        ({"size": 224, "flip": 1.5}, ValueError, "flip"),
        ({"size": 224, "flip": "yes"}, TypeError, "flip"),
        ({"size": 224, "layout": "chw"}, ValueError, "layout"),
    ],
)
def test_bad_parameters_are_refused_at_construction(kwargs, error, parameter):
    with pytest.raises(error, match=f"invalid Image parameter {parameter}:"):
        Image(**kwargs)


def test_bad_decode_values_name_the_field(images):
    with pytest.raises(TypeError, match=r"invalid option decode\[\"jpg\"\]"):
        StreamingDataset(images, decode={"jpg": 3})
    with pytest.raises(ValueError, match=r"invalid option decode\[\"jpg\"\]: unknown decoder"):
        StreamingDataset(images, decode={"jpg": "image"})


def test_parameters_read_back_and_pickle(tmp_path: Path):
    transform = Image((224, 160), scale=(0.25, 1), ratio=(0.5, 2), flip=0.5, layout="HWC")
    assert transform.size == (224, 160) and transform.crop == "random_resized"
    assert transform.scale == (0.25, 1.0) and transform.ratio == (0.5, 2.0)
    assert transform.resize is None and transform.flip == 0.5 and transform.layout == "HWC"
    assert pickle.loads(pickle.dumps(transform)) == transform
    center = Image(224, crop="center")
    assert center.resize == 256 and center.scale is None and center != transform
    assert 'crop="center"' in repr(center)

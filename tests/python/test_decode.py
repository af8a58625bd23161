"""Raw objects (one sample per file or object, local and on S3), field
decoders compared with Python's own decoders on the same bytes (json,
wave + numpy, PIL, numpy.load), decode errors naming key and field, and
batches collated in Rust, all through DataLoader worker processes."""

from __future__ import annotations

import io
import json
import random
import struct
import wave
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from _shardtest import collect, loader, write_tar
from PIL import Image
from s3_server import s3_config as config

import shardstream
from shardstream import StreamingDataset


def as_is(item):
    """DataLoader's per-item hook that keeps items as they are (the default
    turns tuples into lists and numpy arrays into tensors)."""
    return item


SAMPLES = 24


def wav_bytes(rng: random.Random, channels: int, width: int, rate: int) -> bytes:
    frames = rng.randrange(10, 400)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(rng.randbytes(frames * channels * width))
    return buf.getvalue()


def image_bytes(rng: random.Random, fmt: str, mode: str) -> bytes:
    """A smooth image (gradients plus a little noise, like a photo) of a
    random odd or even size."""
    width, height = rng.randrange(3, 60), rng.randrange(3, 60)
    y, x = np.mgrid[0:height, 0:width]
    phases = [rng.uniform(0, 6.28) for _ in range(4)]
    channels = [127 + 100 * np.sin(x / 7 + y / 11 + p) for p in phases]
    noise = np.frombuffer(rng.randbytes(height * width * 4), np.uint8).reshape(height, width, 4)
    pixels = (np.stack(channels, -1) + noise / 32).clip(0, 255).astype(np.uint8)
    img = Image.fromarray(pixels, "RGBA").convert(mode)
    buf = io.BytesIO()
    img.save(buf, fmt, quality=95) if fmt == "JPEG" else img.save(buf, fmt)
    return buf.getvalue()


def npy_bytes(rng: random.Random, index: int) -> bytes:
    dtypes = ["<f4", ">i2", "<u8", "|u1", "<f8", "|b1"]
    shape = (rng.randrange(1, 5), rng.randrange(1, 4))
    array = (np.arange(shape[0] * shape[1]) * (index + 1)).reshape(shape)
    array = array.astype(dtypes[index % len(dtypes)])
    if index % 4 == 0:
        array = np.asfortranarray(array)
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def members(seed: int) -> list[tuple[str, bytes]]:
    """Samples with one field of every decoder kind."""
    rng = random.Random(seed)
    out = []
    for i in range(SAMPLES):
        key = f"s{seed}-{i:03d}"
        meta = {"i": i, "name": f"clip é {i}", "nested": [1, 2.5, None, {"x": True}], "big": 2**63}
        out += [
            (f"{key}.json", json.dumps(meta).encode()),
            (f"{key}.wav", wav_bytes(rng, 1 + i % 2, (1, 2, 3, 4)[i % 4], 8000 + i)),
            (f"{key}.jpg", image_bytes(rng, "JPEG", ("RGB", "L")[i % 2])),
            (f"{key}.png", image_bytes(rng, "PNG", ("RGB", "RGBA", "L", "LA")[i % 4])),
            (f"{key}.npy", npy_bytes(rng, i)),
            (f"{key}.txt", f"caption {i} ünïcode".encode()),
            (f"{key}.cls", f" {i % 10}\n".encode()),
        ]
    return out


def python_wav(data: bytes) -> tuple[np.ndarray, int]:
    """What the audio decoder promises, computed with ``wave`` and numpy."""
    with wave.open(io.BytesIO(data)) as w:
        channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
        raw = w.readframes(w.getnframes())
    if width == 1:
        ints = np.frombuffer(raw, np.uint8).astype(np.int32) - 128
    elif width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        ints = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        ints = np.where(ints >= 1 << 23, ints - (1 << 24), ints)
    else:
        ints = np.frombuffer(raw, {2: "<i2", 4: "<i4"}[width]).astype(np.int64)
    scaled = (ints / float(1 << (8 * width - 1))).astype(np.float32)
    return scaled.reshape(-1, channels), rate


def python_decode(field: str, data: bytes):
    if field == "json":
        return json.loads(data)
    if field == "wav":
        return python_wav(data)
    if field in ("jpg", "png"):
        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    if field == "npy":
        return np.load(io.BytesIO(data))
    if field == "txt":
        return data.decode()
    if field == "cls":
        return int(data.decode().strip())
    raise AssertionError(field)


def assert_decoded(field: str, got, raw: bytes) -> None:
    want = python_decode(field, raw)
    if field == "wav":
        assert isinstance(got, tuple) and got[1] == want[1]
        assert got[0].dtype == np.float32 and got[0].shape == want[0].shape
        np.testing.assert_array_equal(got[0], want[0])
    elif field in ("jpg", "png", "npy"):
        assert isinstance(got, np.ndarray)
        # Big-endian .npy data comes back in native byte order.
        assert got.dtype == want.dtype.newbyteorder("=") and got.shape == want.shape, field
        if field == "jpg":
            # Two JPEG decoders may round differently, by a level or two.
            diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
            assert diff.max() <= 8 and diff.mean() < 1.0
        else:
            np.testing.assert_array_equal(got, want)
    else:
        assert got == want and type(got) is type(want), field


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, dict[str, bytes]]]:
    root = tmp_path_factory.mktemp("decode")
    raw: dict[str, dict[str, bytes]] = {}
    for shard in range(3):
        items = members(shard)
        write_tar(root / f"shard-{shard}.tar", items)
        for name, data in items:
            key, field = name.split(".", 1)
            raw.setdefault(key, {})[field] = data
    return str(root), raw


@pytest.mark.parametrize("num_workers", [0, 2])
def test_default_decoders_match_python(shards, num_workers):
    root, raw = shards
    ds = StreamingDataset(root, decode=True, shuffle_buffer=20)
    samples = collect(loader(ds, num_workers, collate_fn=as_is))
    assert Counter(s["__key__"] for s in samples) == Counter(raw.keys())
    for sample in samples:
        for field, data in raw[sample["__key__"]].items():
            assert_decoded(field, sample[field], data)


def test_decoders_by_field_leave_others_as_bytes(shards):
    root, raw = shards
    ds = StreamingDataset(root, decode={"json": "json", "txt": "str", "wav": "bytes"})
    for sample in collect(ds):
        fields = raw[sample["__key__"]]
        assert sample["json"] == json.loads(fields["json"])
        assert sample["txt"] == fields["txt"].decode()
        for field in ("wav", "jpg", "png", "npy", "cls"):
            assert sample[field] == fields[field]
    with pytest.raises(ValueError, match="rgb8"):
        StreamingDataset(root, decode={"jpg": "jpeg-please"}).__iter__()


def test_decode_error_names_shard_key_and_field(tmp_path):
    path = write_tar(
        tmp_path / "bad.tar",
        [("a.json", b'{"ok": 1}'), ("b.json", b"{not json"), ("c.json", b"[]")],
    )
    ds = StreamingDataset(str(path), decode=True, shuffle_buffer=0)
    with pytest.raises(shardstream.FieldDecodeError, match=r"bad\.tar.*field \"json\".*\"b\""):
        collect(loader(ds, 2, collate_fn=as_is))
    ds = StreamingDataset(str(path), decode=True, shuffle_buffer=0, on_error="warn")
    with pytest.warns(shardstream.ShardSkippedWarning):
        kept = collect(ds)
    assert [s["__key__"] for s in kept] == ["a"]


def gray_png_bomb(side: int) -> bytes:
    """A valid all-black 8-bit grayscale PNG of ``side`` x ``side`` pixels,
    compressed row by row (a few hundred KB for a 16384-pixel side)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    compressor = zlib.compressobj(9)
    row = bytes(side + 1)  # filter byte 0, then the row's pixels
    idat = b"".join(compressor.compress(row) for _ in range(side)) + compressor.flush()
    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


def test_an_image_bomb_is_a_field_decode_error(tmp_path):
    """A grayscale PNG of 16384 x 16384 (256 MiB of pixels, within the
    image crate's own limit) would be 768 MiB as RGB: ``rgb8`` refuses it
    from its header, before allocating, as ``Image()`` does."""
    bomb = gray_png_bomb(16384)
    assert len(bomb) < 1 << 20
    path = write_tar(tmp_path / "bomb.tar", [("a.png", bomb), ("b.json", b"[]")])
    ds = StreamingDataset(str(path), decode={"png": "rgb8"}, shuffle_buffer=0)
    with pytest.raises(shardstream.FieldDecodeError, match=r"16384x16384 pixels.*512 MiB"):
        collect(ds)
    ds = StreamingDataset(str(path), decode={"png": shardstream.Image(32)}, shuffle_buffer=0)
    with pytest.raises(shardstream.FieldDecodeError, match=r"16384x16384 pixels.*512 MiB"):
        collect(ds)


FLAC = Path(__file__).resolve().parents[1] / "data" / "stereo_8k_16bit.flac"


def test_flac_fields_are_decoded_by_default(tmp_path):
    """``decode=True`` reads ``flac`` (any case, as the last extension) with
    the audio decoder, as it reads ``wav``: the same samples as the file's
    own (16-bit PCM of a 440 Hz tone and a ramp, scaled by 2^15)."""
    flac = FLAC.read_bytes()
    path = write_tar(tmp_path / "a.tar", [("a.flac", flac), ("b.take.FLAC", flac)])
    ds = StreamingDataset(str(path), decode=True, shuffle_buffer=0, shuffle_shards=False)
    got = {s["__key__"]: s for s in collect(ds)}
    t = np.arange(300)
    left = np.trunc(20000 * np.sin(2 * np.pi * 440 * t / 8000)) / 32768
    right = ((97 * t) % 65536 - 32768) / 32768
    expected = np.stack([left, right], axis=1).astype(np.float32)
    for key, field in (("a", "flac"), ("b", "take.flac")):  # names are lower-cased
        samples, rate = got[key][field]
        assert rate == 8000
        assert samples.dtype == np.float32 and samples.shape == (300, 2)
        np.testing.assert_array_equal(samples, expected)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_collated_in_rust(shards, num_workers):
    root, raw = shards
    ds = StreamingDataset(
        root, decode={"cls": "int", "npy": "numpy", "txt": "str"}, batch_size=10, shuffle_buffer=0
    )
    batches = collect(loader(ds, num_workers, collate_fn=as_is))
    assert all(len(b["__key__"]) <= 10 for b in batches)
    # The number of batches depends on the workers: no len(), but the samples are known.
    with pytest.raises(TypeError, match="num_samples"):
        len(ds)
    keys = [k for b in batches for k in b["__key__"]]
    assert Counter(keys) == Counter(raw.keys())
    for batch in batches:
        n = len(batch["__key__"])
        # Numbers stack into one array; bytes, strings and ragged arrays stay lists.
        assert isinstance(batch["cls"], np.ndarray) and batch["cls"].dtype == np.int64
        assert batch["cls"].tolist() == [int(raw[k]["cls"].decode()) for k in batch["__key__"]]
        assert batch["txt"] == [raw[k]["txt"].decode() for k in batch["__key__"]]
        assert batch["jpg"] == [raw[k]["jpg"] for k in batch["__key__"]]
        assert isinstance(batch["npy"], list) and len(batch["npy"]) == n
        assert len(batch["__url__"]) == n


def test_equal_shape_arrays_stack(tmp_path):
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 255, (4, 5, 3), dtype=np.uint8) for _ in range(7)]
    items = []
    for i, array in enumerate(arrays):
        buf = io.BytesIO()
        Image.fromarray(array).save(buf, "PNG")
        items.append((f"k{i}.png", buf.getvalue()))
    path = write_tar(tmp_path / "images.tar", items)
    ds = StreamingDataset(
        str(path), decode=True, batch_size=4, shuffle_buffer=0, shuffle_shards=False
    )
    batches = collect(ds)
    assert [b["png"].shape for b in batches] == [(4, 4, 5, 3), (3, 4, 5, 3)]
    np.testing.assert_array_equal(np.concatenate([b["png"] for b in batches]), np.stack(arrays))


def write_raw_objects(root: Path) -> dict[str, bytes]:
    """Files in nested folders, by their expected ``__key__`` and field."""
    rng = random.Random(5)
    written = {}
    for i in range(30):
        folder = root / ("cats" if i % 2 else "dogs") / f"batch{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        name = f"img{i:03d}.jpg" if i % 5 else f"note{i:03d}"
        data = image_bytes(rng, "JPEG", "RGB") if i % 5 else rng.randbytes(i + 1)
        (folder / name).write_bytes(data)
        written[str(folder / name)] = data
    (root / ".hidden").write_bytes(b"skipped")
    return written


@pytest.mark.parametrize("num_workers", [0, 2])
def test_raw_objects_from_a_directory(tmp_path, num_workers):
    written = write_raw_objects(tmp_path)
    ds = StreamingDataset(str(tmp_path), format="raw", shuffle_buffer=8)
    assert len(ds) == ds.num_samples() == len(written)
    samples = collect(loader(ds, num_workers, collate_fn=as_is))
    assert Counter(s["__url__"] for s in samples) == Counter(written.keys())
    for sample in samples:
        data = written[sample["__url__"]]
        path = Path(sample["__url__"])
        if path.suffix == ".jpg":
            assert sample["__key__"] == str(path.with_suffix(""))
            assert sample["jpg"] == data
        else:
            assert sample["__key__"] == str(path)
            assert sample["bytes"] == data
    assert ds.stats()["bytes_read"] == sum(len(d) for d in written.values())


@pytest.mark.parametrize("name", ["x.__url__", "y.__KEY__", "z.__id__"])
def test_a_raw_object_named_as_a_given_name_is_refused(tmp_path, name):
    """Its body would replace the sample's ``__url__`` or ``__key__`` (or be
    replaced): a ``ShardFormatError``, as a tar member of that name is; under
    ``on_error="warn"`` the object is skipped and the others stay."""
    (tmp_path / name).write_bytes(b"body")
    (tmp_path / "ok.bin").write_bytes(b"fine")
    with pytest.raises(shardstream.ShardFormatError, match="rename the object"):
        list(StreamingDataset(str(tmp_path / name), format="raw"))
    with pytest.warns(shardstream.ShardSkippedWarning, match=name.replace(".", r"\.")):
        got = list(StreamingDataset(str(tmp_path), format="raw", on_error="warn"))
    assert [(s["__key__"], s["bin"]) for s in got] == [(str(tmp_path / "ok"), b"fine")]


def test_raw_objects_on_s3_decoded(s3, s3_credentials, tmp_path):
    written = write_raw_objects(tmp_path)
    client = s3.client()
    client.create_bucket(Bucket="rawobjs")
    by_key = {}
    for path, data in written.items():
        key = "raw/" + str(Path(path).relative_to(tmp_path))
        client.put_object(Bucket="rawobjs", Key=key, Body=data)
        by_key[key] = data
    ds = StreamingDataset(
        "s3://rawobjs/raw/", s3=config(s3), format="raw", decode={"jpg": "rgb8"}, seed=1
    )
    samples = collect(loader(ds, 2, collate_fn=as_is))
    assert Counter(s["__url__"] for s in samples) == Counter(f"s3://rawobjs/{k}" for k in by_key)
    for sample in samples:
        key = sample["__url__"].removeprefix("s3://rawobjs/")
        if key.endswith(".jpg"):
            assert sample["__key__"] == key.removesuffix(".jpg")
            assert_decoded("jpg", sample["jpg"], by_key[key])
        else:
            assert sample["bytes"] == by_key[key]
    missing = StreamingDataset("s3://rawobjs/raw/none.jpg", s3=config(s3), format="raw")
    with pytest.raises(shardstream.ShardNotFoundError, match=r"none\.jpg"):
        collect(missing)


def test_batches_resume_exactly(shards):
    root, _ = shards

    def dataset() -> StreamingDataset:
        return StreamingDataset(root, batch_size=7, seed=2, shuffle_buffer=16, decode=True)

    full = [k for b in collect(dataset()) for k in b["__key__"]]
    ds = dataset()
    it = iter(ds)
    head = [k for _ in range(3) for k in next(it)["__key__"]]
    state = ds.state_dict()
    del it
    resumed = dataset()
    resumed.load_state_dict(state)
    tail = [k for b in collect(resumed) for k in b["__key__"]]
    assert head + tail == full
    assert len(head) == 21


def test_large_samples_decode_on_threads_in_order(tmp_path):
    """Batches of pending samples above 256 KiB are decoded on several
    threads; the order and the values must be those of decoding one by one."""
    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 255, (128, 128, 3), dtype=np.uint8) for _ in range(80)]
    items = []
    for i, array in enumerate(arrays):
        buf = io.BytesIO()
        Image.fromarray(array).save(buf, "PNG")
        items.append((f"k{i:03d}.png", buf.getvalue()))
    assert sum(len(d) for _, d in items[:32]) > 256 << 10
    path = write_tar(tmp_path / "big.tar", items)
    raw = [s["__key__"] for s in collect(StreamingDataset(str(path), seed=4, shuffle_buffer=10))]
    decoded = collect(StreamingDataset(str(path), seed=4, shuffle_buffer=10, decode=True))
    assert [s["__key__"] for s in decoded] == raw
    for sample in decoded:
        np.testing.assert_array_equal(sample["png"], arrays[int(sample["__key__"][1:])])


def npy_header_only(shape: str, descr: str = "<f4") -> bytes:
    """A version-1 ``.npy`` file of ``shape`` (a Python tuple's text) with no
    element bytes, padded as numpy pads it."""
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}"
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin-1")


@pytest.mark.parametrize(
    "shape",
    [f"(0, {2**63 - 1})", f"(0, {2**32}, {2**32})", f"({2**64 - 1}, 0)", "(" + "0, " * 70 + ")"],
)
def test_an_npy_shape_numpy_cannot_make_is_a_field_decode_error(tmp_path, shape):
    """A shape with no element whose other dimensions overflow numpy's
    sizes (``npy_intp``, the byte size), or with more dimensions than numpy
    takes, is refused from the header, naming shard, key and field, and
    skipped under ``on_error="warn"``; the next shards are read."""
    empty = io.BytesIO()
    np.save(empty, np.zeros((0, 3), np.float32))
    root = tmp_path / "shards"
    root.mkdir()
    write_tar(root / "a.tar", [("x.npy", empty.getvalue()), ("y.npy", npy_header_only(shape))])
    write_tar(root / "b.tar", [("z.npy", empty.getvalue())])
    strict = StreamingDataset(str(root), decode=True, shuffle_shards=False, shuffle_buffer=0)
    with pytest.raises(shardstream.FieldDecodeError, match=r"a\.tar.*field \"npy\".*\"y\""):
        collect(strict)
    lenient = StreamingDataset(
        str(root), decode=True, shuffle_shards=False, shuffle_buffer=0, on_error="warn"
    )
    with pytest.warns(shardstream.ShardSkippedWarning):
        kept = collect(lenient)
    assert [s["__key__"] for s in kept] == ["x", "z"]
    assert all(s["npy"].shape == (0, 3) for s in kept)

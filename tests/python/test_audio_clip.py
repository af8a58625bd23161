"""``shardstream.AudioClip``: WAV and FLAC fields to fixed-shape float32
clips plus their real frame counts, decided in Rust, deterministic per
sample, resumable exactly."""

from __future__ import annotations

import io
import json
import pickle
import wave
from pathlib import Path

import numpy as np
import pytest
from _shardtest import collect, loader, write_tar
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

from shardstream import AudioClip, FieldDecodeError, StateMismatchError, StreamingDataset

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]

SHARDS, PER_SHARD = 3, 8
FLAC = Path(__file__).resolve().parents[1] / "data" / "stereo_8k_16bit.flac"


def as_is(item):
    """DataLoader's per-item hook that keeps items as they are."""
    return item


def wav_bytes(pcm: np.ndarray, rate: int) -> bytes:
    """A 16-bit WAV of ``pcm`` (frames, channels) in [-1, 1)."""
    ints = np.clip(np.round(pcm * 32768), -32768, 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(ints.shape[1])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(ints.tobytes())
    return buf.getvalue()


def resampled(frames: int, rate_in: int, rate_out: int) -> int:
    return frames if rate_in == rate_out else -(-frames * rate_out // rate_in)


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> tuple[str, dict[str, tuple[int, int]]]:
    """Three shards of stereo WAV noise of several lengths at 44.1 and 16
    kHz; the spec and each key's (frames, rate)."""
    root = tmp_path_factory.mktemp("clips")
    rng = np.random.default_rng(1)
    meta = {}
    for shard in range(SHARDS):
        members = []
        for i in range(PER_SHARD):
            rate = (44100, 16000)[i % 2]
            frames = [300, 9000, 20000, 7000][i % 4]
            key = f"s{shard}-{i:02d}"
            members.append((f"{key}.wav", wav_bytes(rng.uniform(-0.5, 0.5, (frames, 2)), rate)))
            members.append((f"{key}.cls", str(i).encode()))
            meta[key] = (frames, rate)
        write_tar(root / f"part-{shard}.tar", members)
    return str(root / "part-{0..2}.tar"), meta


def by_key(samples, field="wav") -> dict[str, tuple[np.ndarray, int]]:
    out = {}
    for sample in samples:
        keys = sample["__key__"]
        if isinstance(keys, list):
            for key, clip, frames in zip(
                keys, sample[field], sample[f"{field}_frames"], strict=True
            ):
                out[key] = (np.array(clip), int(frames))
        else:
            out[keys] = (np.array(sample[field]), int(sample[f"{field}_frames"]))
    return out


def dataset(spec: str, **kwargs) -> StreamingDataset:
    options = {"seed": 4, "shuffle_buffer": 6, "decode": {"wav": AudioClip(frames=4000)}}
    options.update(kwargs)
    return StreamingDataset(spec, **options)


def test_batches_are_float32_with_frame_counts(clips):
    spec, meta = clips
    ds = dataset(
        spec, decode={"wav": AudioClip(sample_rate=16000, frames=4000), "cls": "int"}, batch_size=5
    )
    batches = collect(loader(ds, 2, collate_fn=as_is))
    assert sum(len(b["__key__"]) for b in batches) == SHARDS * PER_SHARD
    for batch in batches:
        n = len(batch["__key__"])
        clip, frames = batch["wav"], batch["wav_frames"]
        assert isinstance(clip, np.ndarray) and clip.dtype == np.float32 and clip.shape == (n, 4000)
        assert clip.flags["C_CONTIGUOUS"]
        assert isinstance(frames, np.ndarray) and frames.dtype == np.int64 and frames.shape == (n,)
        for key, row, real in zip(batch["__key__"], clip, frames, strict=True):
            length, rate = meta[key]
            assert real == min(4000, resampled(length, rate, 16000)), key
            assert np.all(row[real:] == 0.0) and row[:real].std() > 0.05, key


def test_picked_channels_give_channel_rows(clips):
    spec, _ = clips
    ds = dataset(spec, decode={"wav": AudioClip(channels=[1, 0], frames=100, crop="start")})
    picked = by_key(collect(ds))
    mono = by_key(collect(dataset(spec, decode={"wav": AudioClip(frames=100, crop="start")})))
    for key, (clip, _) in picked.items():
        assert clip.shape == (2, 100) and clip.dtype == np.float32
        # The mean of the two channels is the mono clip.
        np.testing.assert_allclose(clip.mean(axis=0), mono[key][0], atol=1e-5, err_msg=key)
    (one,) = collect(
        StreamingDataset(
            spec.replace("{0..2}", "0"), decode={"wav": AudioClip(channels=(1,), frames=7)}
        )
    )[:1]
    assert one["wav"].shape == (7,)


def test_same_seed_and_epoch_same_clips_whatever_the_workers(clips):
    spec, _ = clips
    alone = by_key(collect(dataset(spec)))
    assert len(alone) == SHARDS * PER_SHARD
    for workers in (1, 3):
        got = by_key(collect(loader(dataset(spec), workers, collate_fn=as_is)))
        assert got.keys() == alone.keys()
        for key, (clip, frames) in alone.items():
            np.testing.assert_array_equal(got[key][0], clip, err_msg=key)
            assert got[key][1] == frames
    other = dataset(spec)
    other.set_epoch(1)
    moved = by_key(collect(other))
    long_keys = [k for k, (_, f) in alone.items() if f == 4000]
    assert sum(np.array_equal(moved[k][0], alone[k][0]) for k in long_keys) <= 2


def resumable(spec: str) -> StatefulDataLoader:
    ds = dataset(spec, decode={"wav": AudioClip(frames=3000), "cls": "int"}, shuffle_buffer=5)
    return StatefulDataLoader(ds, batch_size=4, num_workers=2, collate_fn=as_is, timeout=120)


def flat(batches) -> list[tuple[str, bytes, int]]:
    return [
        (s["__key__"], np.asarray(s["wav"]).tobytes(), int(s["wav_frames"]))
        for batch in batches
        for s in batch
    ]


def test_exact_resume_with_two_workers_and_random_crops(clips):
    spec, _ = clips
    full = flat(collect(resumable(spec)))
    assert len(full) == SHARDS * PER_SHARD
    first = resumable(spec)
    iterator = iter(first)
    prefix = [next(iterator) for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))
    del iterator, first
    resumed = resumable(spec)
    resumed.load_state_dict(state)
    assert flat(prefix) + flat(collect(resumed)) == full


def one_clip(tmp_path: Path, data: bytes, clip: AudioClip, name: str = "a.wav") -> dict:
    path = write_tar(tmp_path / "one.tar", [(name, data)])
    (sample,) = collect(StreamingDataset(str(path), decode={name.split(".", 1)[1]: clip}))
    return sample


@pytest.mark.parametrize(("rate_in", "rate_out"), [(44100, 16000), (16000, 44100), (48000, 8000)])
def test_resampling_keeps_a_tone(tmp_path, rate_in, rate_out):
    t = np.arange(rate_in * 2) / rate_in
    tone = 0.5 * np.sin(2 * np.pi * 1000 * t)
    clip = AudioClip(sample_rate=rate_out, seconds=1.0, crop="center")
    sample = one_clip(tmp_path, wav_bytes(tone[:, None], rate_in), clip)
    x = sample["wav"].astype(np.float64)
    assert x.shape == (rate_out,) and sample["wav_frames"] == rate_out
    spectrum = np.abs(np.fft.rfft(x)) * 2 / x.size
    assert np.argmax(spectrum) == 1000  # 1 Hz bins over one second
    assert abs(spectrum[1000] - 0.5) < 0.005
    # Everything but the tone is 70 dB below it.
    rest = np.sqrt(max(np.mean(x**2) - spectrum[1000] ** 2 / 2, 0))
    assert rest < 1e-4


def test_flac_is_read_like_its_wav(tmp_path):
    clip = AudioClip(sample_rate=8000, channels=[0, 1], frames=400)
    from_flac = one_clip(tmp_path, FLAC.read_bytes(), clip, "a.flac")
    t = np.arange(300)
    left = np.trunc(20000 * np.sin(2 * np.pi * 440 * t / 8000)) / 32768
    right = ((97 * t) % 65536 - 32768) / 32768
    assert from_flac["flac_frames"] == 300
    np.testing.assert_array_equal(
        from_flac["flac"][:, :300], np.stack([left, right]).astype(np.float32)
    )
    assert np.all(from_flac["flac"][:, 300:] == 0)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    length=st.integers(0, 5000),
    frames=st.integers(1, 4000),
    rate_in=st.sampled_from([8000, 16000, 44100]),
    crop=st.sampled_from(["random", "start", "center"]),
    pad=st.sampled_from([0.0, -2.0]),
    seed=st.integers(0, 2**32),
)
def test_crop_and_pad_are_exact(tmp_path, length, frames, rate_in, crop, pad, seed):
    # A ramp of distinct 16-bit values shows where the crop starts.
    ramp = (np.arange(length) - 2500) / 32768
    path = write_tar(tmp_path / "ramp.tar", [("r.wav", wav_bytes(ramp[:, None], rate_in))])
    clip = AudioClip(sample_rate=16000, frames=frames, crop=crop, pad=pad)
    (sample,) = collect(StreamingDataset(str(path), seed=seed, decode={"wav": clip}))
    x, real = sample["wav"], sample["wav_frames"]
    assert x.shape == (frames,) and x.dtype == np.float32
    assert real == min(frames, resampled(length, rate_in, 16000))
    assert np.all(x[real:] == pad)
    if rate_in == 16000 and real:
        first = round(float(x[0]) * 32768) + 2500
        assert first >= 0 and first + real <= length
        if crop == "start":
            assert first == 0
        if crop == "center":
            assert first == (length - real) // 2
        np.testing.assert_array_equal(x[:real], ramp[first : first + real].astype(np.float32))


@pytest.mark.parametrize(
    ("kwargs", "error", "parameter"),
    [
        ({"sample_rate": 0, "frames": 10}, ValueError, "sample_rate"),
        ({"sample_rate": 10**7, "frames": 10}, ValueError, "sample_rate"),
        ({"sample_rate": "16k", "frames": 10}, TypeError, "sample_rate"),
        ({"channels": "stereo", "frames": 10}, ValueError, "channels"),
        ({"channels": [], "frames": 10}, ValueError, "channels"),
        ({"channels": [-1], "frames": 10}, ValueError, "channels"),
        ({"channels": 1, "frames": 10}, TypeError, "channels"),
        ({}, ValueError, "frames"),
        ({"frames": 0}, ValueError, "frames"),
        ({"frames": 2.5}, TypeError, "frames"),
        ({"frames": 10, "seconds": 1.0}, ValueError, "frames"),
        ({"seconds": -1.0}, ValueError, "seconds"),
        ({"seconds": float("nan")}, ValueError, "seconds"),
        ({"frames": 10, "crop": "middle"}, ValueError, "crop"),
        ({"frames": 10, "crop": None, "pad": "zero"}, TypeError, "pad"),
        ({"frames": 10, "pad": float("inf")}, ValueError, "pad"),
    ],
)
def test_bad_parameters_are_refused_by_name(kwargs, error, parameter):
    with pytest.raises(error, match=f"invalid AudioClip parameter {parameter}:"):
        AudioClip(**kwargs)


def test_parameters_repr_pickle_and_fingerprint(clips):
    clip = AudioClip(sample_rate=8000, channels=[1, 0], seconds=0.5, crop="center", pad=-1.0)
    assert (clip.sample_rate, clip.channels, clip.frames, clip.crop, clip.pad) == (
        8000,
        [1, 0],
        4000,
        "center",
        -1.0,
    )
    assert clip.shape == (2, 4000)
    assert AudioClip(frames=5).shape == (5,)
    assert (
        repr(clip)
        == 'AudioClip(sample_rate=8000, channels=[1, 0], frames=4000, crop="center", pad=-1.0)'
    )
    assert pickle.loads(pickle.dumps(clip)) == clip
    spec, _ = clips
    ds = dataset(spec)
    iterator = iter(ds)
    next(iterator)
    state = ds.state_dict()
    del iterator
    other = dataset(spec, decode={"wav": AudioClip(frames=4001)})
    with pytest.raises(StateMismatchError):
        other.load_state_dict(state)
        collect(other)


def test_bad_audio_is_a_field_decode_error(tmp_path):
    path = write_tar(tmp_path / "bad.tar", [("k1.wav", b"RIFF\x00\x00\x00\x00WAVEjunk")])
    ds = StreamingDataset(str(path), decode={"wav": AudioClip(frames=10)})
    with pytest.raises(FieldDecodeError) as info:
        collect(ds)
    message = str(info.value)
    assert "bad.tar" in message and "k1" in message and "wav" in message
    mono = wav_bytes(np.zeros((10, 1)), 16000)
    path = write_tar(tmp_path / "mono.tar", [("k2.wav", mono)])
    with pytest.raises(FieldDecodeError, match="channel 1 was asked for"):
        collect(StreamingDataset(str(path), decode={"wav": AudioClip(channels=[1], frames=10)}))
    path = write_tar(tmp_path / "clash.tar", [("k3.wav", mono), ("k3.wav_frames", b"7")])
    with pytest.raises(FieldDecodeError, match="already has a field"):
        collect(StreamingDataset(str(path), decode={"wav": AudioClip(frames=10)}))


def test_damaged_files_decode_or_fail_cleanly(tmp_path):
    good = wav_bytes(np.random.default_rng(0).uniform(-1, 1, (500, 2)), 44100)
    rng = np.random.default_rng(3)
    clip = AudioClip(frames=64)
    outcomes = {"ok": 0, "error": 0}
    for i in range(30):
        name = "a.wav" if i % 2 else "a.flac"
        data = bytearray(good if i % 2 else FLAC.read_bytes())
        for at in rng.integers(0, len(data), 3):
            data[at] = int(rng.integers(0, 256))
        data = data[: int(rng.integers(len(data) // 2, len(data) + 1))]
        try:
            sample = one_clip(tmp_path, bytes(data), clip, name)
        except FieldDecodeError as error:
            assert "one.tar" in str(error)
            outcomes["error"] += 1
        else:
            field = name.split(".")[1]
            assert sample[field].shape == (64,) and np.isfinite(sample[field]).all()
            outcomes["ok"] += 1
    assert outcomes["error"] > 0

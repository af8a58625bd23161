"""``sample_seed=True``: Python transforms that draw their randomness from
the sample's ``__seed__`` (``shardstream.sample_generator`` /
``sample_rng``) give each sample the same output with any number of
DataLoader workers, after an exact resume (StatefulDataLoader, mid-epoch)
and after an elastic resume (another ``num_workers``), in a ``Mix`` too; a
new epoch draws anew; without the option nothing is added."""

from __future__ import annotations

import io
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from _shardtest import assert_exactly_once, collect, loader, slot_states, write_tar
from PIL import Image
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

import shardstream

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

SEED, SHUFFLE, BATCH, SIZE = 5, 6, 3, 16
SHARDS = (7, 2, 9, 5)


def png(rng: random.Random) -> bytes:
    """A 40x32 RGB PNG of random pixels."""
    pixels = np.frombuffer(rng.randbytes(40 * 32 * 3), dtype=np.uint8).reshape(32, 40, 3)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def write_images(root: Path, prefix: str) -> tuple[str, list[str]]:
    """Tar shards of PNG samples (``.png`` and ``.cls``); their spec and keys."""
    rng = random.Random(prefix)
    keys = []
    for shard, count in enumerate(SHARDS):
        members = []
        for index in range(count):
            key = f"{prefix}{shard}-{index:03d}"
            keys.append(key)
            members += [(f"{key}.png", png(rng)), (f"{key}.cls", str(index % 3).encode())]
        write_tar(root / f"{prefix}-{shard:02d}.tar", members)
    return str(root / f"{prefix}-{{00..{len(SHARDS) - 1:02d}}}.tar"), keys


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    return write_images(tmp_path_factory.mktemp("images"), "img")


@pytest.fixture(scope="module")
def other_images(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    return write_images(tmp_path_factory.mktemp("other"), "oth")


# The recipe of docs/integrations.md: RandomResizedCrop and a horizontal flip
# with their parameters drawn from the sample's generator.


def random_resized_crop_params(
    g: torch.Generator,
    height: int,
    width: int,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
    """``RandomResizedCrop.get_params``, drawing from ``g``."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * torch.empty(1).uniform_(*scale, generator=g).item()
        aspect = math.exp(torch.empty(1).uniform_(*log_ratio, generator=g).item())
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=g))
            left = int(torch.randint(0, width - w + 1, (1,), generator=g))
            return top, left, h, w
    side = min(height, width)
    return (height - side) // 2, (width - side) // 2, side, side


def augment(sample: dict) -> dict:
    """PNG -> random resized crop (SIZE x SIZE) -> random flip, from the
    sample's own generator."""
    g = shardstream.sample_generator(sample)
    image = F.pil_to_tensor(Image.open(io.BytesIO(sample["png"])).convert("RGB"))
    top, left, h, w = random_resized_crop_params(g, image.shape[-2], image.shape[-1])
    image = F.resized_crop(image, top, left, h, w, [SIZE, SIZE], antialias=True)
    flip = bool(torch.rand(1, generator=g) < 0.5)
    if flip:
        image = F.horizontal_flip(image)
    return {"key": sample["__key__"], "image": image, "box": (top, left, h, w), "flip": flip}


STOCK = v2.Compose([v2.RandomResizedCrop(SIZE, antialias=True), v2.RandomHorizontalFlip()])


def augment_stock(sample: dict) -> dict:
    """Stock torchvision transforms, the global RNG seeded from the sample
    inside ``fork_rng`` (restored after)."""
    image = F.pil_to_tensor(Image.open(io.BytesIO(sample["png"])).convert("RGB"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(shardstream.sample_seed(sample))
        image = STOCK(image)
    return {"key": sample["__key__"], "image": image}


def dataset(spec: str, transform=augment, **options) -> shardstream.StreamingDataset:
    options = {
        "seed": SEED,
        "shuffle_buffer": SHUFFLE,
        "sample_seed": True,
        "count_samples": True,  # for elastic resume
        **options,
    }
    return shardstream.StreamingDataset(spec, transform=transform, **options)


def stateful(ds, num_workers: int) -> StatefulDataLoader:
    timeout = 120 if num_workers else 0
    return StatefulDataLoader(
        ds, batch_size=BATCH, num_workers=num_workers, collate_fn=list, timeout=timeout
    )


def flat(batches) -> list[dict]:
    return [o for b in batches for o in b]


def assert_same_outputs(got: list[dict], expected: list[dict]) -> None:
    """Every output of ``got`` is bit-identical to ``expected``'s of its key."""
    by_key = {o["key"]: o for o in expected}
    for o in got:
        want = by_key[o["key"]]
        assert o["image"].dtype == want["image"].dtype == torch.uint8
        assert torch.equal(o["image"], want["image"]), o["key"]


@pytest.mark.parametrize("transform", [augment, augment_stock])
def test_outputs_are_the_same_with_any_worker_count(images, transform):
    spec, keys = images
    runs = {}
    for workers in (0, 2):
        ds = dataset(spec, transform)
        ds.set_epoch(1)
        runs[workers] = flat(collect(stateful(ds, workers)))
        assert_exactly_once([o["key"] for o in runs[workers]], keys)
    assert [o["key"] for o in runs[0]] != [o["key"] for o in runs[2]]
    assert_same_outputs(runs[2], runs[0])
    # The draws are random: many crops, both flips, another epoch other pixels.
    if transform is augment:
        assert len({o["box"] for o in runs[0]}) > len(keys) // 2
        assert {o["flip"] for o in runs[0]} == {True, False}
    ds = dataset(spec, transform)
    ds.set_epoch(2)
    next_epoch = {o["key"]: o["image"] for o in flat(collect(stateful(ds, 2)))}
    differ = [o["key"] for o in runs[0] if not torch.equal(o["image"], next_epoch[o["key"]])]
    assert len(differ) > len(keys) // 2


@pytest.mark.parametrize("k", [1, 4, 6])
def test_exact_resume_gives_bit_identical_outputs(images, k):
    spec, _ = images
    ds = dataset(spec)
    ds.set_epoch(1)
    full = flat(collect(stateful(ds, 2)))
    ds = dataset(spec)
    ds.set_epoch(1)
    dl = stateful(ds, 2)
    iterator = iter(dl)
    prefix = flat(next(iterator) for _ in range(k))
    state = dl.state_dict()
    del iterator, dl
    assert len(slot_states(state)) == 2
    resumed_dl = stateful(dataset(spec), 2)
    resumed_dl.load_state_dict(state)
    resumed = flat(collect(resumed_dl))
    assert [o["key"] for o in prefix + resumed] == [o["key"] for o in full]
    for got, want in zip(prefix + resumed, full, strict=True):
        assert torch.equal(got["image"], want["image"]), got["key"]


def test_elastic_resume_gives_the_same_outputs_per_key(images):
    spec, keys = images
    ds = dataset(spec)
    ds.set_epoch(1)
    full = flat(collect(stateful(ds, 2)))
    ds = dataset(spec)
    ds.set_epoch(1)
    dl = stateful(ds, 2)
    iterator = iter(dl)
    prefix = flat(next(iterator) for _ in range(5))
    state = dl.state_dict()
    del iterator, dl
    for workers in (0, 3):
        ds = dataset(spec)
        ds.load_state_dict(shardstream.elastic_state(state))
        rest = flat(collect(stateful(ds, workers)))
        assert_exactly_once([o["key"] for o in prefix + rest], keys)
        assert_same_outputs(rest, full)


def test_a_mix_gives_the_same_outputs_with_any_worker_count_and_after_a_resume(
    images, other_images
):
    def mix():
        streams = [dataset(images[0]), dataset(other_images[0], seed=SEED + 1)]
        return shardstream.Mix(streams, [2, 1], policy="continue")

    full = flat(collect(stateful(mix(), 0)))
    assert {o["key"][:3] for o in full} == {"img", "oth"}
    assert_same_outputs(flat(collect(stateful(mix(), 2))), full)
    dl = stateful(mix(), 2)
    iterator = iter(dl)
    prefix = flat(next(iterator) for _ in range(4))
    state = dl.state_dict()
    del iterator, dl
    resumed_dl = stateful(mix(), 2)
    resumed_dl.load_state_dict(state)
    rest = flat(collect(resumed_dl))
    two_workers = flat(collect(stateful(mix(), 2)))
    assert [o["key"] for o in prefix + rest] == [o["key"] for o in two_workers]
    assert_same_outputs(prefix + rest, full)


def test_the_seed_is_an_int_per_sample_and_an_int64_column_per_batch(images):
    spec, keys = images
    samples = collect(shardstream.StreamingDataset(spec, seed=SEED, sample_seed=True))
    seeds = {s["__key__"]: s["__seed__"] for s in samples}
    assert all(type(v) is int and 0 <= v < 2**63 for v in seeds.values())
    assert len(set(seeds.values())) == len(keys)
    # The seed is the sample's, whatever the shuffle or the reader.
    other = shardstream.StreamingDataset(
        spec, seed=SEED, sample_seed=True, shuffle_buffer=0, shuffle_shards=False
    )
    assert {s["__key__"]: s["__seed__"] for s in collect(loader(other, 2))} == seeds
    # Another dataset seed, other seeds.
    reseeded = shardstream.StreamingDataset(spec, seed=SEED + 1, sample_seed=True)
    assert not {s["__seed__"] for s in collect(reseeded)} & set(seeds.values())
    batches = collect(shardstream.StreamingDataset(spec, seed=SEED, sample_seed=True, batch_size=4))
    for batch in batches:
        assert batch["__seed__"].dtype == np.int64
        assert list(batch["__seed__"]) == [seeds[k] for k in batch["__key__"]]
    with pytest.raises(TypeError, match="one seed per sample"):
        shardstream.sample_rng(batches[0])
    rng = shardstream.sample_rng(samples[0])
    assert rng.integers(1 << 30) == np.random.default_rng(samples[0]["__seed__"]).integers(1 << 30)


def test_without_the_option_no_seed_is_added_and_the_helpers_say_why(images):
    spec, _ = images
    sample = next(iter(shardstream.StreamingDataset(spec, seed=SEED)))
    assert "__seed__" not in sample
    for helper in (shardstream.sample_rng, shardstream.sample_generator):
        with pytest.raises(ValueError, match="sample_seed=True"):
            helper(sample)
    with pytest.raises(TypeError, match="invalid option sample_seed"):
        shardstream.StreamingDataset(spec, sample_seed=1)
    with pytest.raises(ValueError, match="invalid option sample_seed"):
        shardstream._core.Options(sample_seed=True, batch_format="arrow", shuffle_buffer=0)


def test_a_state_saved_without_the_seed_resumes_with_it(images):
    """The seed changes no order: it is not part of the state's fingerprint."""
    spec, _ = images
    plain = shardstream.StreamingDataset(
        spec, seed=SEED, shuffle_buffer=SHUFFLE, count_samples=True
    )
    dl = DataLoader(plain, batch_size=None)
    iterator = iter(dl)
    head = [next(iterator)["__key__"] for _ in range(6)]
    state = plain.state_dict()
    del iterator, dl
    seeded = dataset(spec, transform=None)
    seeded.load_state_dict(state)
    rest = collect(seeded)
    full = collect(dataset(spec, transform=None))
    assert head + [s["__key__"] for s in rest] == [s["__key__"] for s in full]
    assert [s["__seed__"] for s in rest] == [s["__seed__"] for s in full[6:]]

"""Package surface: lazy torch import, defaults, dataset specs, slot resolution."""

from __future__ import annotations

import gc
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _shardtest import assert_exactly_once, keys_of, sample_digest

import shardstream
from shardstream import _core


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_import_does_not_import_torch():
    proc = run_python(
        "import sys, shardstream\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
        "print(shardstream.__version__)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == _core.__version__


def test_streaming_dataset_imports_torch_lazily():
    proc = run_python(
        "import sys, shardstream\n"
        "assert 'torch' not in sys.modules\n"
        "cls = shardstream.StreamingDataset\n"
        "assert 'torch' in sys.modules\n"
        "import torch.utils.data\n"
        "assert issubclass(cls, torch.utils.data.IterableDataset)\n"
        "from shardstream import StreamingDataset\n"
        "assert StreamingDataset is cls\n"
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", ["StreamingDataset", "Mix"])
def test_without_torch_the_dataset_names_the_install(name):
    proc = run_python(
        "import sys\n"
        "sys.modules['torch'] = None  # as if torch were not installed\n"
        "import shardstream\n"
        "try:\n"
        f"    shardstream.{name}\n"
        "except ModuleNotFoundError as error:\n"
        "    assert error.name == 'torch', error.name\n"
        "    print(error)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert f"shardstream.{name} is a torch IterableDataset" in proc.stdout
    assert "pip install 'shardstream[torch]'" in proc.stdout


def test_len_without_counts_names_every_way_to_get_them(uneven_dataset):
    ds = shardstream.StreamingDataset(uneven_dataset.spec, manifest=False, count_samples=False)
    with pytest.raises(TypeError, match=r"count_samples=True.*ShardWriter.*shardstream index"):
        len(ds)
    assert (
        len(shardstream.StreamingDataset(uneven_dataset.spec, manifest=False, count_samples=True))
        == 86
    )


def test_unknown_attribute_raises_attribute_error():
    with pytest.raises(AttributeError):
        _ = shardstream.NoSuchThing  # type: ignore[attr-defined]


def test_public_names():
    for name in shardstream.__all__:
        assert getattr(shardstream, name) is not None, name
    for name in (
        "DatasetSpecError",
        "ShardFormatError",
        "ShardNotFoundError",
        "ShardReadError",
        "StorageAuthError",
    ):
        assert issubclass(getattr(shardstream, name), shardstream.ShardStreamError), name
    assert issubclass(shardstream.ShardStreamError, Exception)
    assert issubclass(shardstream.ShardSkippedWarning, UserWarning)


def test_slot_arguments_default_to_none():
    params = inspect.signature(shardstream.StreamingDataset.__init__).parameters
    for name in ("rank", "world_size", "num_workers", "worker_id"):
        assert params[name].default is None, name


# --------------------------------------------------------------------------
# Dataset specs.
# --------------------------------------------------------------------------


def ordered(spec, **kwargs):
    """Samples in file order: no shard shuffle, no shuffle buffer."""
    ds = shardstream.StreamingDataset(spec, shuffle_shards=False, shuffle_buffer=0, **kwargs)
    return list(ds)


def test_brace_spec_in_file_order(dataset):
    got = ordered(dataset.spec)
    assert keys_of(got) == dataset.keys
    assert [s["__url__"] for s in got] == [s.url for s in dataset.samples]
    expected = dataset.by_key()
    for sample in got:
        assert sample_digest(sample) == expected[sample["__key__"]].digest()
        assert isinstance(sample["__key__"], str) and isinstance(sample["__url__"], str)


def test_resolve_shards_sizes(dataset):
    resolved = _core.resolve_shards([dataset.spec])
    assert resolved == list(zip(dataset.urls, dataset.sizes, strict=True))
    assert shardstream.resolve_shards([dataset.spec]) == resolved


def test_resolve_shards_missing_file_has_unknown_size(tmp_path):
    missing = str(tmp_path / "nope.tar")
    assert _core.resolve_shards([missing]) == [(missing, None)]


def test_list_of_paths_and_pathlike(dataset):
    paths = [dataset.paths[3], str(dataset.paths[1])]
    got = ordered(paths)
    expected = dataset.keys_of([dataset.urls[3]]) + dataset.keys_of([dataset.urls[1]])
    assert keys_of(got) == expected
    single = ordered(dataset.paths[2])
    assert keys_of(single) == dataset.keys_of([dataset.urls[2]])
    assert {s["__url__"] for s in single} == {dataset.urls[2]}


def test_brace_list_and_several_groups(dataset):
    root = dataset.root
    spec = f"{root}/shard-000{{00,01}}{{0,5}}.tar"
    names = ["shard-000000.tar", "shard-000005.tar", "shard-000010.tar", "shard-000015.tar"]
    expanded = [str(root / n) for n in names if (root / n).exists()]
    assert expanded == [str(root / "shard-000000.tar"), str(root / "shard-000005.tar")]
    # Two of the four expanded names do not exist: resolving keeps them.
    resolved = [url for url, _ in _core.resolve_shards([spec])]
    assert resolved == [str(root / n) for n in names]
    list_spec = f"{root}/shard-00000{{3,1,6}}.tar"
    got = ordered(list_spec)
    expected_urls = [str(root / f"shard-00000{i}.tar") for i in (3, 1, 6)]
    assert keys_of(got) == [k for u in expected_urls for k in dataset.keys_of([u])]


def test_unpadded_range(tmp_path, dataset):
    for i in range(3):
        (tmp_path / f"part{i}.tar").write_bytes(dataset.paths[i].read_bytes())
    got = ordered(f"{tmp_path}/part{{0..2}}.tar")
    assert [s["__url__"] for s in got] == [
        str(tmp_path / f"part{i}.tar") for i in range(3) for _ in dataset.keys_of([dataset.urls[i]])
    ]


def test_file_url(dataset):
    url = f"file://{dataset.paths[4]}"
    got = ordered(url)
    assert keys_of(got) == dataset.keys_of([dataset.urls[4]])
    assert {s["__url__"] for s in got} == {url}


def test_directory_spec_sorted_tar_only(tmp_path, dataset):
    for i in (2, 0, 1):
        (tmp_path / f"shard-{i:06d}.tar").write_bytes(dataset.paths[i].read_bytes())
    (tmp_path / "notes.txt").write_text("not a shard")
    (tmp_path / "sub.tar").mkdir()  # a directory named *.tar is not a shard
    got = ordered(tmp_path)
    expected_urls = [f"{tmp_path}/shard-{i:06d}.tar" for i in range(3)]
    assert [s["__url__"] for s in got] == [
        u for i, u in enumerate(expected_urls) for _ in dataset.keys_of([dataset.urls[i]])
    ]
    assert keys_of(got) == dataset.keys_of(dataset.urls[:3])
    # A trailing slash on the directory does not double it.
    got_slash = ordered(f"{tmp_path}/")
    assert [s["__url__"] for s in got_slash] == [s["__url__"] for s in got]


def test_a_directory_lists_shard_suffixes_in_any_case(tmp_path, dataset):
    """Names made on a case-insensitive file system. Before, ``.TAR`` was
    passed over: its samples left out, no error."""
    names = ["a.TAR", "b.Tar", "c.tar"]
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(dataset.paths[i].read_bytes())
    (tmp_path / "d.TAR.bak").write_text("not a shard")
    got = ordered(tmp_path)
    assert [s["__url__"] for s in got] == [
        f"{tmp_path}/{name}"
        for i, name in enumerate(names)
        for _ in dataset.keys_of([dataset.urls[i]])
    ]
    assert keys_of(got) == dataset.keys_of(dataset.urls[:3])


def test_a_directory_of_links_gives_the_shards_they_point_to(tmp_path, dataset):
    """A Hugging Face cache snapshot holds links to its blobs. Before, a
    directory's links were not listed: their samples were left out, no
    error. A dangling link is a missing shard, which its read reports."""
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "shard-000000.tar").write_bytes(dataset.paths[0].read_bytes())
    for i in (1, 2):
        (snapshot / f"shard-{i:06d}.tar").symlink_to(dataset.paths[i])
    assert keys_of(ordered(snapshot)) == dataset.keys_of(dataset.urls[:3])
    (snapshot / "shard-000003.tar").symlink_to(tmp_path / "gone.tar")
    with pytest.raises(shardstream.ShardNotFoundError, match=r"shard-000003\.tar"):
        ordered(snapshot)


# --------------------------------------------------------------------------
# Rank and worker resolution.
# --------------------------------------------------------------------------


def rank_keys(spec, **kwargs):
    return set(keys_of(shardstream.StreamingDataset(spec, **kwargs)))


def test_env_rank_and_world_size(dataset, monkeypatch):
    explicit = [rank_keys(dataset.spec, rank=r, world_size=3) for r in range(3)]
    assert_exactly_once([k for keys in explicit for k in keys], dataset.keys)
    monkeypatch.setenv("WORLD_SIZE", "3")
    for r in range(3):
        monkeypatch.setenv("RANK", str(r))
        ds = shardstream.StreamingDataset(dataset.spec)
        assert ds.distributed_slot() == (r, 3)
        assert rank_keys(dataset.spec) == explicit[r]


def test_explicit_arguments_beat_env(dataset, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = shardstream.StreamingDataset(dataset.spec, rank=0, world_size=1)
    assert ds.distributed_slot() == (0, 1)
    assert_exactly_once(keys_of(ds), dataset.keys)


def test_explicit_and_env_mix_per_argument(dataset, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    ds = shardstream.StreamingDataset(dataset.spec, rank=2)
    assert ds.distributed_slot() == (2, 3)
    assert set(keys_of(ds)) == rank_keys(dataset.spec, rank=2, world_size=3)


def test_defaults_without_env(dataset, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ds = shardstream.StreamingDataset(dataset.spec)
    assert ds.distributed_slot() == (0, 1)
    assert ds.worker_slot() == (0, 1)
    assert_exactly_once(keys_of(ds), dataset.keys)


def test_explicit_worker_slots_partition(dataset):
    got = []
    for worker in range(3):
        ds = shardstream.StreamingDataset(dataset.spec, num_workers=3, worker_id=worker)
        assert ds.worker_slot() == (worker, 3)
        got += keys_of(ds)
    assert_exactly_once(got, dataset.keys)


@pytest.mark.parametrize("loader_workers", [0, 1, 3])
def test_num_workers_without_worker_id_must_match_the_loader(dataset, loader_workers):
    """Before, ``num_workers=2`` iterated by another count of workers read
    worker 0's share (or each worker's of 2) only, while ``len()`` said the
    whole rank: the rest was left out without a word."""
    from torch.utils.data import DataLoader

    ds = shardstream.StreamingDataset(dataset.spec, num_workers=2)
    loader = DataLoader(ds, batch_size=None, num_workers=loader_workers)
    with pytest.raises(ValueError, match="invalid option num_workers: 2 was given"):
        list(loader)
    matching = shardstream.StreamingDataset(dataset.spec, num_workers=2)
    assert_exactly_once(keys_of(DataLoader(matching, batch_size=None, num_workers=2)), dataset.keys)


def test_invalid_slot_raises_value_error(dataset, monkeypatch):
    # Explicit arguments are checked when the dataset is created.
    with pytest.raises(ValueError, match="rank"):
        shardstream.StreamingDataset(dataset.spec, rank=2, world_size=2)
    with pytest.raises(ValueError, match="worker_id"):
        shardstream.StreamingDataset(dataset.spec, num_workers=2, worker_id=2)
    with pytest.raises(ValueError, match="world_size"):
        shardstream.StreamingDataset(dataset.spec, rank=0, world_size=0)
    # A slot from the environment, when the stream starts.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    ds = shardstream.StreamingDataset(dataset.spec)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ValueError, match="rank"):
        iter(ds)


def test_set_epoch_rejects_negative(dataset):
    ds = shardstream.StreamingDataset(dataset.spec)
    with pytest.raises(ValueError):
        ds.set_epoch(-1)
    # The epoch after the last must fit too: 2**63 - 1 went on to epoch 0.
    for epoch in (2**63, 2**63 - 1):
        with pytest.raises(ValueError, match="below 2\\*\\*63 - 1"):
            ds.set_epoch(epoch)
    ds.set_epoch(2**63 - 2)
    # Named, not an operator's error.
    for value in (1.0, "1", None, True):
        with pytest.raises(TypeError, match="epoch must be an int"):
            ds.set_epoch(value)
    for value in (1.0, "1"):
        with pytest.raises(TypeError, match="epoch must be an int"):
            shardstream.Mix([ds], [1.0]).set_epoch(value)
    # numpy's integers are ints.
    import numpy as np

    ds.set_epoch(np.int64(3))
    assert ds.epoch == 3


def test_going_on_past_the_last_epoch_raises(dataset):
    """The epoch after the last is refused, not wrapped round: from
    2**63 - 1 the next iteration streamed epoch 0 again, without a word."""
    ds = shardstream.StreamingDataset(dataset.spec)
    ds.set_epoch(2**63 - 2)
    assert len(list(ds)) == len(dataset.samples)
    with pytest.raises(ValueError, match="epoch 9223372036854775807 is past the last one"):
        iter(ds)
    # A state that finished the last epoch leaves nothing; the next
    # iteration would be past it.
    other = shardstream.StreamingDataset(dataset.spec)
    other.set_epoch(2**63 - 2)
    list(other)
    again = shardstream.StreamingDataset(dataset.spec)
    again.load_state_dict(other.state_dict())
    assert list(again) == []
    with pytest.raises(ValueError, match="past the last one"):
        iter(again)
    # A Mix's epochs are below 2**32.
    mix = shardstream.Mix([shardstream.StreamingDataset(dataset.spec)], [1.0])
    mix.set_epoch(2**32 - 1)
    assert len(list(mix)) == len(dataset.samples)
    with pytest.raises(ValueError, match="epoch 4294967296 is past the last one, 4294967295"):
        iter(mix)


def test_stats_in_process(dataset):
    # Whole shards (no sample counts), so every byte of every file is read.
    # The second pass would start the third epoch's reads as it ends, and
    # count their bytes by the time stats() is called.
    ds = shardstream.StreamingDataset(
        dataset.spec, count_samples=False, read_next_epoch_early=False
    )
    names = (
        "shards_opened shards_completed samples bytes_read errors_skipped requests retries "
        "resumed_bodies read_ahead_peak_bytes cache_hits cache_bytes storage_wait_ns "
        "pipeline_ns decode_ns decode_busy_ns output_wait_ns transform_ns handoff_ns "
        "next_wait_ns parsed_bytes decoded_bytes output_queue_samples parse_ns read_ahead_bytes"
    )
    assert ds.stats() == dict.fromkeys(names.split(), 0)
    assert_exactly_once(keys_of(ds), dataset.keys)
    stats = ds.stats()
    assert stats["samples"] == len(dataset.samples)
    assert stats["bytes_read"] == sum(dataset.sizes)
    assert stats["shards_opened"] == stats["shards_completed"] == len(dataset.paths)
    assert stats["errors_skipped"] == 0
    # A second epoch adds to the same counters.
    ds.set_epoch(1)
    assert_exactly_once(keys_of(ds), dataset.keys)
    assert ds.stats()["samples"] == 2 * len(dataset.samples)
    assert ds.stats()["bytes_read"] == 2 * sum(dataset.sizes)


def test_repr_mentions_shard_count(dataset):
    text = repr(shardstream.StreamingDataset(dataset.spec, seed=5))
    assert f"{len(dataset.paths)} shards" in text and "seed=5" in text


def test_dataset_pickles(dataset):
    import pickle

    ds = shardstream.StreamingDataset(dataset.spec, seed=3, shuffle_buffer=7)
    ds.set_epoch(2)
    clone = pickle.loads(pickle.dumps(ds))
    assert keys_of(clone) == keys_of(ds)


def test_example_generator_is_deterministic(tmp_path, make_dataset, dataset):
    again = make_dataset(
        tmp_path,
        shards=2,
        samples_per_shard=len(dataset.keys_of([dataset.urls[0]])),
        seed=1234,
        min_seconds=0.05,
        max_seconds=0.2,
    )
    for path, original in zip(again, dataset.paths[:2], strict=True):
        assert Path(path).read_bytes() == original.read_bytes()
    assert os.path.basename(again[0]) == dataset.paths[0].name


# --------------------------------------------------------------------------
# Silent mistakes made loud: a decode key that matches no field, a
# DataLoader batching Rust batches again, a local glob.
# --------------------------------------------------------------------------


def test_a_decode_key_matching_no_field_warns_once_naming_the_fields(dataset):
    import warnings

    ds = shardstream.StreamingDataset(dataset.spec, decode={"wave": "json", "json": "json"})
    with pytest.warns(shardstream.DecodeFieldWarning, match="decode key 'wave'") as caught:
        first = list(ds)
    (warning,) = [w for w in caught if issubclass(w.category, shardstream.DecodeFieldWarning)]
    assert "'json'" not in str(warning.message).split("fields are")[0]
    assert "fields are 'wav', 'json'" in str(warning.message) or (
        "fields are 'json', 'wav'" in str(warning.message)
    )
    assert issubclass(shardstream.DecodeFieldWarning, UserWarning)
    # Once per dataset: the next epoch, and a good key, say nothing; the
    # samples are as without the check (the known key decoded).
    assert isinstance(first[0]["json"], dict) and isinstance(first[0]["wav"], bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("error", shardstream.DecodeFieldWarning)
        assert len(list(ds)) == len(first)
        assert len(list(shardstream.StreamingDataset(dataset.spec, decode={"json": "json"}))) > 0


def test_a_decode_key_matching_no_field_warns_with_batches_too(dataset):
    from torch.utils.data import DataLoader

    ds = shardstream.StreamingDataset(dataset.spec, decode={"jpeg": "rgb8"}, batch_size=4)
    with pytest.warns(shardstream.DecodeFieldWarning, match="decode key 'jpeg'"):
        batches = list(DataLoader(ds, batch_size=None))
    assert sum(len(b["__key__"]) for b in batches) == len(dataset.keys)


def test_a_dataloader_batching_rust_batches_again_is_an_error_naming_the_fix(dataset):
    from torch.utils.data import DataLoader

    ds = shardstream.StreamingDataset(dataset.spec, decode=True, batch_size=4, shuffle_buffer=0)
    for num_workers in (0, 2):
        # The DataLoader's default batch_size=1 would give (1, 4, ...) tensors.
        with pytest.raises(ValueError, match=r"batch_size=None"):
            next(iter(DataLoader(ds, num_workers=num_workers, timeout=120 if num_workers else 0)))
    # The refused iterators (kept alive by the tracebacks pytest.raises
    # held) are collected here, not in the workers forked next: CPython
    # 3.11's import lock raises KeyError when a finalizer imports during an
    # import (numpy.random's, in a worker), and the worker dies.
    gc.collect()
    good = DataLoader(ds, batch_size=None, num_workers=2, timeout=120)
    batches = list(good)
    assert {len(b["__key__"]) for b in batches[:-1]} == {4}
    assert sum(len(b["__key__"]) for b in batches) == len(dataset.keys)
    # A batch is still a dict, and a collate_fn of the user's own is theirs.
    assert isinstance(batches[0], dict)
    own = DataLoader(ds, batch_size=2, collate_fn=lambda items: [b["__key__"] for b in items])
    assert [len(pair) for pair in next(iter(own))] == [4, 4]


def test_a_local_glob_is_not_found_with_a_hint_that_globs_are_for_hf(dataset):
    spec = str(Path(dataset.paths[0]).parent / "shard-*.tar")
    with pytest.raises(shardstream.ShardNotFoundError, match=r"glob patterns .* hf://") as caught:
        shardstream.StreamingDataset(spec)
    assert "shard-*.tar" in str(caught.value)
    with pytest.raises(shardstream.ShardNotFoundError) as plain:
        shardstream.StreamingDataset(str(Path(dataset.paths[0]).parent / "missing.tar"))
    assert "glob" not in str(plain.value)

"""``pack_bytes=True``: each bytes field of a Rust batch as one ``uint8``
array of its members end to end, plus ``<field>_offsets`` (``int64``, one
more than the batch's samples), instead of a list of ``bytes``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from _shardtest import DatasetInfo, assert_exactly_once, collect, loader, write_tar

from shardstream import StreamingDataset


def unpacked(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """The samples of a packed batch, each bytes field cut out of its buffer
    by its offsets (numpy arrays or torch tensors)."""
    keys = list(batch["__key__"])
    samples: list[dict[str, Any]] = [{"__key__": key} for key in keys]
    for name, column in batch.items():
        if name.startswith("__") or name.endswith("_offsets"):
            continue
        data = np.asarray(column)
        offsets = np.asarray(batch[f"{name}_offsets"])
        assert data.dtype == np.uint8 and data.ndim == 1, (name, data.dtype, data.shape)
        assert offsets.dtype == np.int64 and offsets.shape == (len(keys) + 1,)
        assert offsets[0] == 0 and offsets[-1] == len(data)
        for i, sample in enumerate(samples):
            sample[name] = data[offsets[i] : offsets[i + 1]].tobytes()
    return samples


def test_packed_batches_hold_the_listed_bytes_in_the_same_order(dataset: DatasetInfo):
    def batches(pack: bool) -> list[dict[str, Any]]:
        ds = StreamingDataset(dataset.spec, seed=5, shuffle_buffer=8, batch_size=5, pack_bytes=pack)
        return collect(ds)

    listed, packed = batches(False), batches(True)
    assert [b["__key__"] for b in packed] == [b["__key__"] for b in listed]
    # The last batch of the epoch is short (96 samples in batches of 5).
    assert len(packed[-1]["__key__"]) == len(dataset.keys) % 5 != 0
    expected = dataset.by_key()
    for batch, plain in zip(packed, listed, strict=True):
        assert list(batch) == ["__key__", "__url__", "wav", "wav_offsets", "json", "json_offsets"]
        assert batch["__url__"] == plain["__url__"]
        for i, sample in enumerate(unpacked(batch)):
            assert sample["wav"] == plain["wav"][i] == expected[sample["__key__"]].fields["wav"]
            assert sample["json"] == plain["json"][i]


def test_decoded_fields_are_not_packed_and_sparse_fields_stay_lists(tmp_path):
    members = []
    for i in range(6):
        members.append((f"k{i}.bin", bytes([i]) * (i + 1)))
        members.append((f"k{i}.cls", str(i).encode()))
        if i % 2 == 0:
            members.append((f"k{i}.txt", b"even"))
    path = write_tar(tmp_path / "a.tar", members)
    ds = StreamingDataset(
        str(path), batch_size=6, shuffle_buffer=0, decode={"cls": "int"}, pack_bytes=True
    )
    [batch] = collect(ds)
    assert batch["bin"].tobytes() == b"".join(bytes([i]) * (i + 1) for i in range(6))
    assert batch["bin_offsets"].tolist() == [0, 1, 3, 6, 10, 15, 21]
    assert batch["cls"].tolist() == list(range(6))
    assert "cls_offsets" not in batch
    # Samples 1, 3 and 5 have no .txt: a list, None where a sample lacks it.
    assert batch["txt"] == [b"even", None, b"even", None, b"even", None]
    assert "txt_offsets" not in batch


def test_offsets_that_would_take_a_fields_name_are_a_value_error(tmp_path):
    path = write_tar(
        tmp_path / "clash.tar", [("k0.jpg", b"\xff\xd8"), ("k0.jpg_offsets", b"whatever")]
    )
    ds = StreamingDataset(str(path), batch_size=4, pack_bytes=True)
    with pytest.raises(ValueError, match=r"invalid option pack_bytes: .*\"jpg_offsets\"") as error:
        collect(ds)
    assert "k0" in str(error.value) and "clash.tar" in str(error.value)
    # Without packing the same shard reads.
    [batch] = collect(StreamingDataset(str(path), batch_size=4))
    assert batch["jpg_offsets"] == [b"whatever"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, r"invalid option pack_bytes: .*batch_size is not given"),
        ({"batch_size": 4, "batch_format": "arrow"}, r"invalid option pack_bytes: .*\"arrow\""),
    ],
)
def test_pack_bytes_without_dict_batches_is_refused_at_construction(
    dataset: DatasetInfo, options: dict[str, Any], message: str
):
    with pytest.raises(ValueError, match=message):
        StreamingDataset(dataset.spec, pack_bytes=True, **options)


def test_pack_bytes_must_be_a_bool(dataset: DatasetInfo):
    with pytest.raises(TypeError, match="invalid option pack_bytes"):
        StreamingDataset(dataset.spec, batch_size=4, pack_bytes="yes")


def test_workers_hand_packed_batches_out_as_tensors_exactly_once(dataset: DatasetInfo):
    ds = StreamingDataset(dataset.spec, seed=1, batch_size=8, pack_bytes=True)
    batches = collect(loader(ds, num_workers=2))
    expected = dataset.by_key()
    keys = []
    for batch in batches:
        # DataLoader(batch_size=None) turns the numpy arrays into tensors.
        assert isinstance(batch["wav"], torch.Tensor) and batch["wav"].dtype == torch.uint8
        assert batch["wav_offsets"].dtype == torch.int64
        for sample in unpacked(batch):
            keys.append(sample["__key__"])
            assert sample["wav"] == expected[sample["__key__"]].fields["wav"]
    assert_exactly_once(keys, dataset.keys)


def test_packed_batches_resume_exactly(dataset: DatasetInfo):
    def make() -> StreamingDataset:
        return StreamingDataset(
            dataset.spec, seed=3, shuffle_buffer=16, batch_size=7, pack_bytes=True
        )

    full = [s["wav"] for b in collect(make()) for s in unpacked(b)]
    ds = make()
    it = iter(ds)
    head = [s["wav"] for _ in range(3) for s in unpacked(next(it))]
    state = ds.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    tail = [s["wav"] for b in collect(resumed) for s in unpacked(b)]
    assert len(head) == 21
    assert head + tail == full

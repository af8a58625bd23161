"""A job's layout (``world_size`` x ``num_workers`` slots) is bounded at
construction, so a typo is a ``ValueError`` naming the option, never an
abort or a ``PanicException`` at the first ``next()``; and a stream plans
only its own slot, so a job of a million ranks costs each rank its own
units, not a list per slot."""

from __future__ import annotations

import pytest
from _shardtest import epoch_sequence, shardstream_cli, write_uneven_dataset

from shardstream import StreamingDataset

MAX_WORLD_SIZE = 1 << 20
MAX_SLOTS = 1 << 24


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_uneven_dataset(tmp_path_factory.mktemp("layout"))


@pytest.mark.parametrize(
    ("layout", "named"),
    [
        ({"world_size": 10**11}, r"world_size: must be at most 1048576, got 100000000000"),
        ({"world_size": 2**70}, r"world_size: must be at most 1048576"),
        ({"world_size": 2**32, "num_workers": 2**32}, r"world_size: must be at most"),
        (
            {"world_size": MAX_WORLD_SIZE, "num_workers": 1024},
            r"num_workers: world_size x num_workers must be at most 16777216 slots",
        ),
        ({"num_workers": 2**64}, r"num_workers: must be at most 16777216"),
    ],
)
def test_a_layout_past_the_limits_is_refused_at_construction(dataset, layout, named):
    with pytest.raises(ValueError, match=named):
        StreamingDataset(dataset.spec, **layout)


def test_the_largest_layout_plans_each_slot_alone(dataset):
    """At the largest world size, with 16 workers (2^24 slots), a stream
    gets exactly its own samples: with ``remainder="pad"`` each rank has one
    sample of the epoch, the rank's position in the epoch's sequence."""
    total = len(dataset.keys)
    sequence = epoch_sequence(dataset, seed=3, epoch=0)
    for rank in (0, 5, MAX_WORLD_SIZE - 1):
        got = {}
        for worker in (0, 1):
            ds = StreamingDataset(
                dataset.spec,
                seed=3,
                world_size=MAX_WORLD_SIZE,
                rank=rank,
                num_workers=16,
                worker_id=worker,
                remainder="pad",
                shuffle_buffer=0,
            )
            assert len(ds) == 1
            got[worker] = [s["__key__"] for s in ds]
        assert got == {0: [sequence[rank % total]], 1: []}


def test_the_cli_refuses_a_huge_world_size_with_an_error(dataset):
    proc = shardstream_cli("plan", dataset.spec, "--world-size", "100000000000", "--no-count")
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "world_size" in proc.stderr and "at most 1048576" in proc.stderr

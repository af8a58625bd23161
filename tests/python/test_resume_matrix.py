"""The resume matrix: every way a loader's state is saved and loaded (a
plain DataLoader with the dataset's own state, ``StatefulDataLoader``,
torchdata.nodes, Accelerate's ``prepare_loader``, torch.distributed.checkpoint,
``Mix``, the Lightning callback) x ``num_workers`` x where the checkpoint is
taken (before the first batch, mid-epoch, at the epoch's last batch, after
the epoch ended) x exact or elastic resume. Each run is stopped at the
checkpoint, its loader and dataset dropped, and a new one resumed from what
the checkpoint holds, as a restarted process would.

- exact: what the first run took, then the resumed run, equals the
  uninterrupted run, batch for batch;
- elastic: a job of 2 ranks stopped at the point resumes as 3 ranks with
  another worker count: every sample of the epoch comes exactly once
  (``remainder="drop"`` leaves out fewer than 3), every new rank the same
  number.

Ranks are simulated in one process with explicit ``rank``/``world_size``;
the torchrun tests of each integration check the same with real processes.
"""

from __future__ import annotations

import json
import pickle
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _shardtest import key_batch, slot_states, write_uneven_dataset
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import shardstream

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning:torch.distributed.checkpoint"),
    pytest.mark.filterwarnings("ignore:.*torch.distributed.*:UserWarning"),
]

SEED, EPOCH, BATCH, SHUFFLE = 4, 3, 4, 6
POINTS = ["before-first", "mid-epoch", "last-batch", "after-epoch"]


def key_batch_of(batch: Any) -> list[str]:
    """The keys of a batch as every path yields it."""
    return list(batch)


class Route:
    """One way of saving and loading a loader's state."""

    name = ""
    # The epoch the run streams (Accelerate sets its own iteration count).
    epoch = EPOCH
    workers: tuple[int, ...] = (0, 2)
    elastic = True

    def loader(self, ds: Any, num_workers: int) -> Any:
        return StatefulDataLoader(
            ds,
            batch_size=BATCH,
            num_workers=num_workers,
            collate_fn=key_batch,
            timeout=120 if num_workers else 0,
        )

    def checkpoint(self, loader: Any, tmp: Path) -> Any:
        """What a checkpoint of ``loader`` holds, as read back from disk."""
        return json.loads(json.dumps(loader.state_dict()))

    def restore(self, loader: Any, saved: Any) -> None:
        loader.load_state_dict(saved)


class Stateful(Route):
    name = "stateful-dataloader"
    # 3 workers: shares that batch_size does not divide, each worker ending
    # on its own partial batch.
    workers = (0, 2, 3)


class DatasetState(Route):
    """A plain DataLoader; the state is the dataset's own (one process)."""

    name = "dataset-state"
    workers = (0,)

    def loader(self, ds: Any, num_workers: int) -> Any:
        return DataLoader(ds, batch_size=BATCH, num_workers=num_workers, collate_fn=key_batch)

    def checkpoint(self, loader: Any, tmp: Path) -> Any:
        return json.loads(json.dumps(loader.dataset.state_dict()))

    def restore(self, loader: Any, saved: Any) -> None:
        loader.dataset.load_state_dict(saved)


class Nodes(Route):
    """torchdata.nodes: IterableWrapper, Batcher, Loader."""

    name = "torchdata-nodes"
    workers = (0,)

    def loader(self, ds: Any, num_workers: int) -> Any:
        from torchdata.nodes import Batcher, IterableWrapper, Loader, Mapper

        batches = Batcher(IterableWrapper(ds), batch_size=BATCH, drop_last=False)
        return Loader(Mapper(batches, key_batch))


class Accelerate(Route):
    """``shardstream.accelerate.prepare_loader`` with a stateful loader."""

    name = "accelerate"
    epoch = 0

    def loader(self, ds: Any, num_workers: int) -> Any:
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration

        from shardstream.accelerate import prepare_loader

        accelerator = Accelerator(
            cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
        )
        plain = DataLoader(ds, batch_size=BATCH, num_workers=num_workers, collate_fn=key_batch)
        return prepare_loader(accelerator, plain)


class Dcp(Route):
    """torch.distributed.checkpoint of the loader's state (pickled, as
    ``examples/dcp_resume.py`` does), in one process."""

    name = "dcp"

    def checkpoint(self, loader: Any, tmp: Path) -> Any:
        import torch.distributed.checkpoint as dcp

        where = tmp / f"dcp-{id(loader)}"
        dcp.save({"loader": pickle.dumps(loader.state_dict())}, checkpoint_id=str(where))
        holder: dict[str, Any] = {"loader": b""}
        dcp.load(holder, checkpoint_id=str(where))
        return pickle.loads(holder["loader"])


ROUTES = [Stateful(), DatasetState(), Nodes(), Accelerate(), Dcp()]


def dataset(info: Any, epoch: int = EPOCH, **slot: Any) -> shardstream.StreamingDataset:
    ds = shardstream.StreamingDataset(
        info.spec, seed=SEED, shuffle_buffer=SHUFFLE, remainder="drop", **slot
    )
    ds.set_epoch(epoch)
    return ds


def stop_at(point: str, n: int) -> int:
    return {"before-first": 0, "mid-epoch": n // 2, "last-batch": n, "after-epoch": n}[point]


def run_until(
    route: Route, ds: Any, num_workers: int, point: str, n: int, tmp: Path
) -> tuple[list[list[str]], Any]:
    """The batches a run takes before the checkpoint at ``point``, and what
    the checkpoint holds; the run's loader is then dropped."""
    loader = route.loader(ds, num_workers)
    taken: list[list[str]] = []
    if point != "before-first":
        iterator: Iterator[Any] | None = iter(loader)
        assert iterator is not None
        taken = [key_batch_of(next(iterator)) for _ in range(stop_at(point, n))]
        if point == "after-epoch":
            assert next(iterator, None) is None
        del iterator
    saved = route.checkpoint(loader, tmp)
    del loader
    return taken, saved


def passes(loader: Any, count: int) -> list[list[list[str]]]:
    return [[key_batch_of(b) for b in loader] for _ in range(count)]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """69 samples in 5 shards (so 2 ranks split evenly, 3 do not)."""
    return write_uneven_dataset(tmp_path_factory.mktemp("matrix"), (11, 30, 2, 0, 26), seed=5)


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize(
    ("route", "num_workers"),
    [(r, w) for r in ROUTES for w in r.workers],
    ids=[f"{r.name}-w{w}" for r in ROUTES for w in r.workers],
)
def test_exact(data, tmp_path, route: Route, num_workers: int, point: str):
    full, following = passes(route.loader(dataset(data, route.epoch), num_workers), 2)
    assert sorted(k for b in full for k in b) == sorted(data.keys)
    taken, saved = run_until(
        route, dataset(data, route.epoch), num_workers, point, len(full), tmp_path
    )
    assert slot_states(saved), "the checkpoint holds no shardstream state"
    loader = route.loader(dataset(data, epoch=0), num_workers)
    route.restore(loader, saved)
    rest = passes(loader, 2)
    if point == "after-epoch":
        assert taken == full
        # The dataset's own state of an ended epoch resumes to an empty pass
        # (a loader that stopped with its last, partial batch must not start
        # the next epoch in the same pass; set_epoch(EPOCH + 1) skips it);
        # the loaders that saw the end start the next epoch.
        if route.name == "dataset-state":
            assert rest[0] == []
            rest = rest[1:]
        assert rest[0] == following
    elif point == "last-batch" and rest[0] != []:
        # Loaders that know they yielded the epoch's last batch (Accelerate
        # marks it, torchdata.nodes too) start the next epoch at once.
        assert taken == full
        assert rest[0] == following
    else:
        assert taken + rest[0] == full
        assert rest[1] == following


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize(
    ("route", "num_workers"),
    [(r, w) for r in ROUTES if r.elastic for w in r.workers],
    ids=[f"{r.name}-w{w}" for r in ROUTES if r.elastic for w in r.workers],
)
def test_elastic(data, tmp_path, route: Route, num_workers: int, point: str):
    """2 ranks stop at ``point``; 3 ranks with another worker count take
    the rest (through a plain DataLoader over the loaded dataset, and two
    more epochs after it)."""
    old_world, new_world, new_workers = 2, 3, 0 if num_workers else 2
    consumed: list[str] = []
    states = []
    for rank in range(old_world):
        ds = dataset(data, route.epoch, rank=rank, world_size=old_world)
        n = len(passes(route.loader(ds, num_workers), 1)[0])
        ds = dataset(data, route.epoch, rank=rank, world_size=old_world)
        taken, saved = run_until(route, ds, num_workers, point, n, tmp_path)
        consumed += [k for b in taken for k in b]
        states.append(saved)
    elastic = shardstream.elastic_state(*states)
    per_rank: list[list[str]] = []
    later: list[list[list[str]]] = []
    for rank in range(new_world):
        ds = dataset(data, epoch=0, rank=rank, world_size=new_world)
        ds.load_state_dict(elastic)
        rest, *after = passes(route.loader(ds, new_workers), 3)
        per_rank.append([k for b in rest for k in b])
        later.append([[k for b in p for k in b] for p in after])
    everything = consumed + [k for keys in per_rank for k in keys]
    repeats = [k for k, c in Counter(everything).items() if c > 1]
    assert not repeats, f"came twice: {repeats[:5]}"
    missing = set(data.keys) - set(everything)
    # Each layout's remainder policy may leave out fewer samples than it has ranks.
    assert len(missing) <= old_world - 1 + new_world - 1, f"never came: {sorted(missing)[:5]}"
    if point != "after-epoch":
        assert len({len(keys) for keys in per_rank}) == 1, [len(k) for k in per_rank]
    # The epochs after the resumed one are whole, split among the new ranks.
    for p in range(2):
        epoch_keys = [k for rank in later for k in rank[p]]
        assert len(epoch_keys) == len(set(epoch_keys)) >= len(data.keys) - (new_world - 1)


def mix_of(info: Any, other: Any, **slot: Any) -> shardstream.Mix:
    a = shardstream.StreamingDataset(info.spec, seed=1, shuffle_buffer=5, **slot)
    b = shardstream.StreamingDataset(other.spec, seed=2, shuffle_buffer=3, **slot)
    mix = shardstream.Mix([a, b], [0.6, 0.4], policy="stop", seed=7)
    mix.set_epoch(EPOCH)
    return mix


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_mix_exact(data, tmp_path_factory, tmp_path, num_workers: int, point: str):
    other = write_uneven_dataset(tmp_path_factory.mktemp("mix-other"), (7, 9), prefix="o")
    route = Stateful()
    full, following = passes(route.loader(mix_of(data, other), num_workers), 2)
    taken, saved = run_until(route, mix_of(data, other), num_workers, point, len(full), tmp_path)
    loader = route.loader(mix_of(data, other), num_workers)
    route.restore(loader, saved)
    rest = passes(loader, 2)
    if point == "after-epoch":
        assert taken == full and rest[0] == following
    else:
        assert taken + rest[0] == full and rest[1] == following


@pytest.mark.parametrize("point", ["before-first", "mid-epoch", "last-batch"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_lightning_callback_exact(data, tmp_path, num_workers: int, point: str):
    """A Lightning run (``ShardStreamCallback``, a ``StatefulDataLoader``)
    checkpointed at ``point`` and resumed from the checkpoint by a new
    Trainer trains on exactly the uninterrupted run's remaining batches."""
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer

    from shardstream.lightning import ShardStreamCallback

    class Recorder(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.seen: list[list[str]] = []

        def training_step(self, batch: list[str], batch_idx: int) -> torch.Tensor:
            self.seen.append(list(batch))
            return self.layer(torch.ones(1, 1)).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ckpt = tmp_path / "run.ckpt"
    n = -(-len(data.keys) // BATCH)
    at = stop_at(point, n)

    class SaveAt(Callback):
        def on_train_epoch_start(self, trainer: Trainer, *args: object) -> None:
            if at == 0:
                trainer.save_checkpoint(ckpt)

        def on_train_batch_end(self, trainer: Trainer, *args: object) -> None:
            if trainer.global_step == at:
                trainer.save_checkpoint(ckpt)

    def fit(callbacks: list[Callback], resume: Path | None) -> list[list[str]]:
        # Counted, so len() works and Lightning reads no batch ahead.
        ds = shardstream.StreamingDataset(
            data.spec, seed=SEED, shuffle_buffer=SHUFFLE, count_samples=True
        )
        loader = StatefulDataLoader(
            ds,
            batch_size=BATCH,
            num_workers=num_workers,
            collate_fn=key_batch,
            timeout=120 if num_workers else 0,
        )
        model = Recorder()
        trainer = Trainer(
            max_epochs=1,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[ShardStreamCallback(), *callbacks],
            default_root_dir=tmp_path,
        )
        trainer.fit(model, loader, ckpt_path=resume)
        return model.seen

    full = fit([SaveAt()], None)
    assert len(full) == n and ckpt.exists()
    rest = fit([], ckpt)
    assert full[:at] + rest == full


def test_lightning_refuses_a_stateful_loader_without_len(data, tmp_path):
    """Without sample counts Lightning reads a batch ahead, so its
    checkpoints would resume a batch late: refused when training starts."""
    import torch
    from lightning.pytorch import LightningModule, Trainer

    from shardstream.accelerate import FrameworkWrapperError
    from shardstream.lightning import ShardStreamCallback

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: list[str], batch_idx: int) -> torch.Tensor:
            return self.layer(torch.ones(1, 1)).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ds = shardstream.StreamingDataset(data.spec, seed=SEED, count_samples=False)
    loader = StatefulDataLoader(ds, batch_size=BATCH, collate_fn=key_batch)
    trainer = Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ShardStreamCallback()],
        default_root_dir=tmp_path,
    )
    with pytest.raises(FrameworkWrapperError, match=r"a batch ahead.*count_samples=True"):
        trainer.fit(Model(), loader)


@pytest.mark.parametrize("kind", ["dataset", "mix"])
def test_set_epoch_after_the_loader_made_its_iterator(data, tmp_path_factory, kind):
    """``StatefulDataLoader`` makes its iterator to take a state before the
    first batch; a ``set_epoch`` after that (Accelerate's loader does it)
    is the epoch that iterator streams, and its state describes it."""
    other = write_uneven_dataset(tmp_path_factory.mktemp("epoch-other"), (7, 9), prefix="o")

    def source(epoch: int) -> Any:
        made = mix_of(data, other) if kind == "mix" else dataset(data)
        made.set_epoch(epoch)
        return made

    route = Stateful()
    full = passes(route.loader(source(0), 0), 1)[0]
    ds = source(EPOCH)
    loader = route.loader(ds, 0)
    loader.state_dict()
    ds.set_epoch(0)
    iterator = iter(loader)
    taken = [key_batch_of(next(iterator)) for _ in range(5)]
    saved = json.loads(json.dumps(loader.state_dict()))
    del iterator, loader
    resumed = route.loader(source(0), 0)
    resumed.load_state_dict(saved)
    assert taken + passes(resumed, 1)[0] == full

"""The resume matrix: every way a loader's state is saved and loaded (a plain
DataLoader with the dataset's own state, ``StatefulDataLoader``,
torchdata.nodes, Accelerate's ``prepare_loader``,
torch.distributed.checkpoint, Lightning Fabric, ``Mix``, packed sequences,
the Lightning callback, the HF Trainer) x ``num_workers`` (persistent
workers too) x where the checkpoint is taken
(before the first batch, mid-epoch, at the epoch's last batch, after the
epoch ended) x exact or elastic resume. Each run is stopped at the
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _shardtest import keys_and_ones, slot_states, write_uneven_dataset
from lightning.pytorch import Callback, LightningModule, Trainer
from test_pack import write_docs
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import shardstream
from shardstream import Ledger, Pack
from shardstream._core import run_cli

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning:torch.distributed.checkpoint"),
    pytest.mark.filterwarnings("ignore:.*torch.distributed.*:UserWarning"),
]

SEED, EPOCH, BATCH, SHUFFLE = 4, 3, 4, 6
POINTS = ["before-first", "mid-epoch", "last-batch", "after-epoch"]


def keys_and_ids(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``collate_fn``: the batch's keys, and its sample ids for the ledger
    (an ``int64`` array of ``(epoch, shard, index)`` rows) when the samples
    carry them."""
    batch: dict[str, Any] = {"keys": [s["__key__"] for s in samples]}
    if samples and "__id__" in samples[0]:
        batch["__id__"] = np.array([s["__id__"] for s in samples], dtype=np.int64)
    return batch


def key_batch_of(batch: Any) -> list[str]:
    """The keys of a batch as every path yields it (a Rust batch of packed
    sequences: each sequence's tokens)."""
    if "input_ids" in batch:
        return [str(row) for row in batch["input_ids"].tolist()]
    return list(batch["keys"])


class Route:
    """One way of saving and loading a loader's state."""

    name = ""
    # The epoch the run streams (Accelerate sets its own iteration count).
    epoch = EPOCH
    workers: tuple[int, ...] = (0, 2)
    elastic = True
    persistent_workers = False

    def loader(self, ds: Any, num_workers: int) -> Any:
        return StatefulDataLoader(
            ds,
            batch_size=BATCH,
            num_workers=num_workers,
            collate_fn=keys_and_ids,
            timeout=120 if num_workers else 0,
            persistent_workers=self.persistent_workers and num_workers > 0,
        )

    def reference(self, ds: Any, num_workers: int) -> Any:
        """The loader whose uninterrupted passes a resumed run must equal."""
        return self.loader(ds, num_workers)

    def elastic_workers(self, num_workers: int) -> int:
        """The worker count of the new ranks of an elastic resume: another
        than the old ranks had."""
        return 0 if num_workers else 2

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


class Persistent(Stateful):
    """``StatefulDataLoader`` with ``persistent_workers=True``: each
    worker starts its next epoch's stream when its epoch ends
    (``read_next_epoch_early``), so a checkpoint after the epoch and the
    resumed run's second pass meet a stream started early."""

    name = "stateful-persistent"
    workers = (3,)
    persistent_workers = True

    def reference(self, ds: Any, num_workers: int) -> Any:
        # Workers made afresh each epoch: an early start must not change
        # what an epoch streams.
        return Stateful().loader(ds, num_workers)

    def elastic_workers(self, num_workers: int) -> int:
        return 2


class DatasetState(Route):
    """A plain DataLoader; the state is the dataset's own (one process)."""

    name = "dataset-state"
    workers = (0,)

    def loader(self, ds: Any, num_workers: int) -> Any:
        return DataLoader(ds, batch_size=BATCH, num_workers=num_workers, collate_fn=keys_and_ids)

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
        return Loader(Mapper(batches, keys_and_ids))


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
        plain = DataLoader(ds, batch_size=BATCH, num_workers=num_workers, collate_fn=keys_and_ids)
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


class Fabric(Route):
    """Lightning Fabric: ``setup_dataloaders`` over a ``StatefulDataLoader``,
    ``fabric.save`` of ``all_rank_states`` and ``fabric.load`` (one device)."""

    name = "fabric"

    @staticmethod
    def fabric() -> Any:
        from lightning.fabric import Fabric

        return Fabric(accelerator="cpu", devices=1)

    def loader(self, ds: Any, num_workers: int) -> Any:
        return self.fabric().setup_dataloaders(super().loader(ds, num_workers))

    def checkpoint(self, loader: Any, tmp: Path) -> Any:
        from shardstream.lightning import all_rank_states

        fabric, where = self.fabric(), tmp / f"fabric-{id(loader)}.ckpt"
        fabric.save(where, {"loader": all_rank_states(loader)})
        return fabric.load(where)["loader"]

    def restore(self, loader: Any, saved: Any) -> None:
        from shardstream.lightning import load_rank_state

        load_rank_state(loader, saved)


ROUTES = [Stateful(), Persistent(), DatasetState(), Nodes(), Accelerate(), Dcp(), Fabric()]


def dataset(info: Any, epoch: int = EPOCH, **slot: Any) -> shardstream.StreamingDataset:
    ds = shardstream.StreamingDataset(
        info.spec, seed=SEED, shuffle_buffer=SHUFFLE, remainder="drop", sample_ids=True, **slot
    )
    ds.set_epoch(epoch)
    return ds


def stop_at(point: str, n: int) -> int:
    return {"before-first": 0, "mid-epoch": n // 2, "last-batch": n, "after-epoch": n}[point]


def run_until(
    route: Route,
    ds: Any,
    num_workers: int,
    point: str,
    n: int,
    tmp: Path,
    ledger: Ledger | None = None,
    loader: Any = None,
) -> tuple[list[list[str]], Any, int]:
    """The batches a run takes before the checkpoint at ``point`` (each
    recorded in ``ledger``), what the checkpoint holds, and the step a run
    resumed from it takes first; the run's loader (``route``'s over ``ds``
    unless given) is then dropped."""
    if loader is None:
        loader = route.loader(ds, num_workers)
    taken: list[list[str]] = []
    if point != "before-first":
        iterator: Iterator[Any] | None = iter(loader)
        assert iterator is not None
        for _ in range(stop_at(point, n)):
            batch = next(iterator)
            if ledger is not None:
                ledger.record(batch)
            taken.append(key_batch_of(batch))
        if point == "after-epoch":
            assert next(iterator, None) is None
            if ledger is not None:
                ledger.epoch_end(int(batch["__id__"][0][0]))
        del iterator
    saved = route.checkpoint(loader, tmp)
    step = ledger.checkpoint() if ledger is not None else 0
    del loader
    return taken, saved, step


def passes(loader: Any, count: int, ledger: Ledger | None = None) -> list[list[list[str]]]:
    """``count`` passes over ``loader``, each recorded in ``ledger``."""
    return [
        [key_batch_of(b) for b in (ledger.track(loader) if ledger is not None else loader)]
        for _ in range(count)
    ]


def verified(ledger_dir: Path, capfd: pytest.CaptureFixture[str]) -> str:
    """``shardstream verify`` of the run's ledger: its report, after
    checking that it proves every epoch exactly once."""
    capfd.readouterr()
    code = run_cli(["shardstream", "verify", str(ledger_dir)])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert "exactly once" in out, out
    return out


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
def test_exact(data, tmp_path, capfd, route: Route, num_workers: int, point: str):
    full, following = passes(route.reference(dataset(data, route.epoch), num_workers), 2)
    assert sorted(k for b in full for k in b) == sorted(data.keys)
    ledger_dir = tmp_path / "ledger"
    first = dataset(data, route.epoch)
    with Ledger(ledger_dir, first, num_workers=max(num_workers, 1)) as ledger:
        taken, saved, step = run_until(
            route, first, num_workers, point, len(full), tmp_path, ledger
        )
    assert slot_states(saved), "the checkpoint holds no shardstream state"
    second = dataset(data, epoch=0)
    loader = route.loader(second, num_workers)
    route.restore(loader, saved)
    with Ledger(ledger_dir, second, resume_step=step, num_workers=max(num_workers, 1)) as ledger:
        rest = passes(loader, 2, ledger)
    verified(ledger_dir, capfd)
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
def test_elastic(data, tmp_path, capfd, route: Route, num_workers: int, point: str):
    """2 ranks stop at ``point``; 3 ranks with another worker count take
    the rest (through a plain DataLoader over the loaded dataset, and two
    more epochs after it). The ledger of both generations verifies."""
    old_world, new_world, new_workers = 2, 3, route.elastic_workers(num_workers)
    ledger_dir = tmp_path / "ledger"
    consumed: list[str] = []
    states = []
    old = [dataset(data, route.epoch, rank=r, world_size=old_world) for r in range(old_world)]
    ledgers = [Ledger(ledger_dir, ds, num_workers=max(num_workers, 1)) for ds in old]
    steps = []
    for rank, (ds, ledger) in enumerate(zip(old, ledgers, strict=True)):
        count = dataset(data, route.epoch, rank=rank, world_size=old_world)
        n = len(passes(route.loader(count, num_workers), 1)[0])
        taken, saved, step = run_until(route, ds, num_workers, point, n, tmp_path, ledger)
        ledger.close()
        consumed += [k for b in taken for k in b]
        states.append(saved)
        steps.append(step)
    assert len(set(steps)) == 1, steps
    elastic = shardstream.elastic_state(*states)
    new = [dataset(data, epoch=0, rank=r, world_size=new_world) for r in range(new_world)]
    ledgers = [
        Ledger(ledger_dir, ds, resume_step=steps[0], num_workers=max(new_workers, 1)) for ds in new
    ]
    per_rank: list[list[str]] = []
    later: list[list[list[str]]] = []
    for ds, ledger in zip(new, ledgers, strict=True):
        ds.load_state_dict(elastic)
        rest, *after = passes(route.loader(ds, new_workers), 3, ledger)
        ledger.close()
        per_rank.append([k for b in rest for k in b])
        later.append([[k for b in p for k in b] for p in after])
    # The ledger of both generations proves every epoch exactly once.
    verified(ledger_dir, capfd)
    # The same by keys: the first pass of a new rank is the rest of the
    # saved epoch, or, after a state of an ended epoch, an empty pass or
    # (Accelerate, which starts from the dataset's epoch) the next epoch.
    if point in ("last-batch", "after-epoch") and any(per_rank):
        later = [[rest, *after] for rest, after in zip(per_rank, later, strict=True)]
        per_rank = [[] for _ in per_rank]
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


def mix_of(info: Any, other: Any, epoch: int = EPOCH, **options: Any) -> shardstream.Mix:
    a = shardstream.StreamingDataset(info.spec, seed=1, shuffle_buffer=5, **options)
    b = shardstream.StreamingDataset(other.spec, seed=2, shuffle_buffer=3, **options)
    mix = shardstream.Mix([a, b], [0.6, 0.4], policy="stop", seed=7)
    mix.set_epoch(epoch)
    return mix


MIX_ROUTES = [(Stateful(), 0), (Stateful(), 2), (Persistent(), 3)]


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize(
    ("route", "num_workers"), MIX_ROUTES, ids=[f"{r.name}-w{w}" for r, w in MIX_ROUTES]
)
def test_mix_exact(data, tmp_path_factory, tmp_path, route: Route, num_workers: int, point: str):
    other = write_uneven_dataset(tmp_path_factory.mktemp("mix-other"), (7, 9), prefix="o")
    full, following = passes(route.reference(mix_of(data, other), num_workers), 2)
    taken, saved, _ = run_until(route, mix_of(data, other), num_workers, point, len(full), tmp_path)
    loader = route.loader(mix_of(data, other), num_workers)
    route.restore(loader, saved)
    rest = passes(loader, 2)
    if point == "after-epoch":
        assert taken == full and rest[0] == following
    else:
        assert taken + rest[0] == full and rest[1] == following


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize(
    ("route", "num_workers"), MIX_ROUTES, ids=[f"{r.name}-w{w}" for r, w in MIX_ROUTES]
)
def test_packed_exact(tmp_path, capfd, route: Route, num_workers: int, point: str):
    """Packed sequences (``Pack``, Rust batches of 2) through the same
    checkpoints: the resumed run's sequences are the uninterrupted run's,
    the next epoch whole, and the ledger proves each document once."""
    urls = write_docs(tmp_path / "d", shards=3)

    def source(epoch: int = EPOCH) -> shardstream.StreamingDataset:
        ds = shardstream.StreamingDataset(
            urls, pack=Pack(8, field="ids"), batch_size=2, seed=SEED,
            shuffle_buffer=SHUFFLE, sample_ids=True,
        )  # fmt: skip
        ds.set_epoch(epoch)
        return ds

    def loader(ds: Any, persistent: bool) -> StatefulDataLoader:
        return StatefulDataLoader(
            ds, batch_size=None, num_workers=num_workers, timeout=120 if num_workers else 0,
            persistent_workers=persistent,
        )  # fmt: skip

    full, following = passes(loader(source(), False), 2)
    ledger_dir, workers = tmp_path / "ledger", max(num_workers, 1)
    first = source()
    with Ledger(ledger_dir, first, num_workers=workers) as ledger:
        first_loader = loader(first, route.persistent_workers)
        taken, saved, step = run_until(
            route, first, num_workers, point, len(full), tmp_path, ledger, first_loader
        )
        del first_loader
    assert slot_states(saved), "the checkpoint holds no shardstream state"
    second = source(epoch=0)
    resumed = loader(second, route.persistent_workers)
    route.restore(resumed, saved)
    with Ledger(ledger_dir, second, resume_step=step, num_workers=workers) as ledger:
        rest = passes(resumed, 2, ledger)
    verified(ledger_dir, capfd)
    if point == "after-epoch" or (point == "last-batch" and rest[0] != []):
        assert taken == full and rest[0] == following
    else:
        assert taken + rest[0] == full and rest[1] == following


@pytest.mark.parametrize("point", ["before-first", "mid-epoch", "last-batch"])
@pytest.mark.parametrize("kind", ["dataset", "mix"])
def test_persistent_checkpoint_in_an_early_started_epoch(
    data, tmp_path_factory, tmp_path, capfd, kind: str, point: str
):
    """Persistent workers (3) read a whole epoch, so each has started its
    next epoch's streams before the next iteration asks; a checkpoint at
    ``point`` of that early-started epoch resumes exactly on a new loader,
    and the ledger of both runs verifies."""
    other = write_uneven_dataset(tmp_path_factory.mktemp("early-other"), (7, 9), prefix="o")

    def source(epoch: int = EPOCH) -> Any:
        if kind == "mix":
            return mix_of(data, other, epoch, sample_ids=True)
        return dataset(data, epoch)

    route, workers = Persistent(), 3
    first_epoch, full, following = passes(route.reference(source(), workers), 3)
    ledger_dir = tmp_path / "ledger"
    ds = source()
    with Ledger(ledger_dir, ds, num_workers=workers) as ledger:
        loader = route.loader(ds, workers)
        assert passes(loader, 1, ledger)[0] == first_epoch
        taken, saved, step = run_until(
            route, ds, workers, point, len(full), tmp_path, ledger, loader
        )
        # The run stops: its workers and the streams they started go.
        del loader
    assert slot_states(saved), "the checkpoint holds no shardstream state"
    resumed = route.loader(source(epoch=0), workers)
    route.restore(resumed, saved)
    with Ledger(ledger_dir, resumed.dataset, resume_step=step, num_workers=workers) as ledger:
        rest = passes(resumed, 2, ledger)
    verified(ledger_dir, capfd)
    if point == "last-batch" and rest[0] != []:
        assert taken == full and rest[0] == following
    else:
        assert taken + rest[0] == full and rest[1] == following


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_accelerate_writes_the_ledger(data, tmp_path, capfd, num_workers: int, point: str):
    """``prepare_loader(ledger_dir=...)`` records the batches itself;
    ``accelerator.save_state`` at ``point`` keeps the ledger's resume step
    and ``load_state`` in a new Accelerator starts the resumed run's
    generation there: the run is exact, and its ledger verifies with the
    epochs complete."""
    accelerate_ledger_run(lambda: dataset(data, 0), tmp_path, capfd, num_workers, point)


def test_accelerate_writes_a_mix_ledger(data, tmp_path_factory, tmp_path, capfd):
    """The same with a ``Mix`` saved mid-epoch (2 workers): its ledger
    verifies against the mixture's plan."""
    other = write_uneven_dataset(tmp_path_factory.mktemp("mix-other"), (7, 9), prefix="o")

    def made() -> shardstream.Mix:
        return mix_of(data, other, epoch=0, sample_ids=True)

    accelerate_ledger_run(made, tmp_path, capfd, 2, "mid-epoch")


def accelerate_ledger_run(
    made: Callable[[], Any], tmp_path: Path, capfd: Any, num_workers: int, point: str
) -> None:
    """A run of ``made()`` through ``prepare_loader(ledger_dir=...)``,
    saved at ``point``, resumed in a new Accelerator: checked exact, and
    its ledger verified with the epochs complete."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    from shardstream.accelerate import prepare_loader

    ledger_dir, checkpoint = tmp_path / "ledger", tmp_path / "checkpoint"

    def prepared() -> tuple[Any, Any]:
        accelerator = Accelerator(
            cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
        )
        plain = DataLoader(
            made(), batch_size=BATCH, num_workers=num_workers, collate_fn=keys_and_ids
        )
        return accelerator, prepare_loader(accelerator, plain, ledger_dir=ledger_dir)

    full, following = passes(Accelerate().loader(made(), num_workers), 2)
    accelerator, loader = prepared()
    taken = []
    if point != "before-first":
        iterator = iter(loader)
        taken = [key_batch_of(next(iterator)) for _ in range(stop_at(point, len(full)))]
        if point == "after-epoch":
            assert next(iterator, None) is None
        del iterator
    accelerator.save_state(str(checkpoint))
    loader.ledger.close()  # the process ends
    accelerator, loader = prepared()
    accelerator.load_state(str(checkpoint))
    rest = passes(loader, 2)
    loader.ledger.close()
    report = verified(ledger_dir, capfd)
    if point in ("last-batch", "after-epoch"):
        assert taken == full and rest[0] == following
    else:
        assert taken + rest[0] == full and rest[1] == following
    assert "in progress" not in report and report.count("exactly once") >= 2, report


class KeysModel(torch.nn.Module):
    """A model for the HF Trainer that records the keys of its batches."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[list[str]] = []

    def forward(self, ones: torch.Tensor, keys: list[str]) -> dict[str, torch.Tensor]:
        self.seen.append(list(keys))
        return {"loss": self.layer(ones).sum()}


@pytest.mark.parametrize(
    ("num_workers", "point"), [(0, "mid-epoch"), (2, "mid-epoch"), (2, "last-batch")]
)
def test_hf_trainer_writes_the_ledger(data, tmp_path, capfd, num_workers: int, point: str):
    """``shardstream.transformers.StreamingTrainer(ledger_dir=...)``: a run
    of 2 epochs saves a checkpoint at ``point`` and goes on; a new Trainer
    resumed from that checkpoint trains on exactly the rest, and the
    ledger of both runs verifies, both epochs complete."""
    from transformers import TrainingArguments

    from shardstream.transformers import StreamingTrainer

    n = -(-len(data.keys) // BATCH)
    at = stop_at(point, n)
    ledger_dir = tmp_path / "ledger"

    def train(resume: Path | None = None) -> list[list[str]]:
        model = KeysModel()
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"),
            per_device_train_batch_size=BATCH,
            num_train_epochs=2,
            dataloader_num_workers=num_workers,
            dataloader_persistent_workers=num_workers > 0,
            remove_unused_columns=False,
            save_strategy="steps",
            save_steps=at,
            save_only_model=False,
            report_to=[],
            disable_tqdm=True,
            use_cpu=True,
        )
        ds = shardstream.StreamingDataset(
            data.spec, seed=SEED, shuffle_buffer=SHUFFLE, count_samples=True, sample_ids=True
        )
        trainer = StreamingTrainer(
            model=model,
            args=args,
            train_dataset=ds,
            data_collator=keys_and_ones,
            ledger_dir=ledger_dir,
        )
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        return model.seen

    full = train()
    assert len(full) == 2 * n
    assert sorted(k for b in full[:n] for k in b) == sorted(data.keys)
    rest = train(tmp_path / "out" / f"checkpoint-{at}")
    assert full[:at] + rest == full
    assert sorted(p.name for p in ledger_dir.iterdir()) == ["gen-000000", "gen-000001"]
    report = verified(ledger_dir, capfd)
    assert "in progress" not in report and report.count("exactly once") == 3, report


class Recorder(LightningModule):
    """A model that records the keys of the batches it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[list[str]] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.seen.append(list(batch["keys"]))
        return self.layer(torch.ones(1, 1)).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def lightning_fit(
    loader: Any,
    tmp: Path,
    callbacks: list[Callback],
    resume: Path | None = None,
    ledger_dir: Path | None = None,
) -> list[list[str]]:
    """One epoch of ``Trainer.fit`` with ``ShardStreamCallback`` on the
    CPU (resumed from ``resume``; writing its ledger to ``ledger_dir``):
    the batches it trained on."""
    from shardstream.lightning import ShardStreamCallback

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
        callbacks=[ShardStreamCallback(ledger_dir=ledger_dir), *callbacks],
        default_root_dir=tmp,
    )
    trainer.fit(model, loader, ckpt_path=resume)
    return model.seen


@pytest.mark.parametrize("point", ["before-first", "mid-epoch", "last-batch"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_lightning_callback_exact(data, tmp_path, capfd, num_workers: int, point: str):
    """A Lightning run (``ShardStreamCallback``, a ``StatefulDataLoader``)
    checkpointed at ``point`` and resumed from the checkpoint by a new
    Trainer trains on exactly the uninterrupted run's remaining batches;
    the callback's ledger of both runs verifies."""
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

    def loader() -> StatefulDataLoader:
        # Counted, so len() works and Lightning reads no batch ahead.
        ds = shardstream.StreamingDataset(
            data.spec, seed=SEED, shuffle_buffer=SHUFFLE, count_samples=True, sample_ids=True
        )
        return StatefulDataLoader(
            ds,
            batch_size=BATCH,
            num_workers=num_workers,
            collate_fn=keys_and_ids,
            timeout=120 if num_workers else 0,
        )

    ledger_dir = tmp_path / "ledger"
    full = lightning_fit(loader(), tmp_path, [SaveAt()], ledger_dir=ledger_dir)
    assert len(full) == n and ckpt.exists()
    rest = lightning_fit(loader(), tmp_path, [], ckpt, ledger_dir=ledger_dir)
    assert full[:at] + rest == full
    # Two generations: the run that went on past its checkpoint, and the
    # run resumed from it, whose steps supersede the first's from there.
    assert sorted(p.name for p in ledger_dir.iterdir()) == ["gen-000000", "gen-000001"]
    report = verified(ledger_dir, capfd)
    # The callback recorded the epoch's end too: the epoch is complete.
    assert "in progress" not in report and f"{len(data.keys)} of {len(data.keys)}" in report


def test_lightning_refuses_a_stateful_loader_without_len(data, tmp_path):
    """Without sample counts Lightning reads a batch ahead, so its
    checkpoints would resume a batch late: refused when training starts."""
    from shardstream.accelerate import FrameworkWrapperError

    ds = shardstream.StreamingDataset(data.spec, seed=SEED, count_samples=False)
    loader = StatefulDataLoader(ds, batch_size=BATCH, collate_fn=keys_and_ids)
    with pytest.raises(FrameworkWrapperError, match=r"a batch ahead.*count_samples=True"):
        lightning_fit(loader, tmp_path, [])


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

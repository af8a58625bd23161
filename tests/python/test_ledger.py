"""``shardstream.Ledger`` and ``shardstream verify``: real DataLoader runs
(worker processes), a killed and resumed run, a resume from the wrong state,
and an elastic resume onto another world size, each proved (or refuted) by
the verifier replaying the plan."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _shardtest import DatasetInfo
from test_pack import write_docs
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import shardstream
from shardstream._core import run_cli

SEED = 11


def verify(capfd: pytest.CaptureFixture[str], ledger: Path, *args: str) -> tuple[int, str]:
    """``shardstream verify LEDGER ARGS``: its exit code and output."""
    capfd.readouterr()
    code = run_cli(["shardstream", "verify", str(ledger), *args])
    out, err = capfd.readouterr()
    return code, out + err


def make(spec: str, **options: Any) -> Any:
    return shardstream.StreamingDataset(spec, seed=SEED, sample_ids=True, **options)


def ids_only(samples: list[dict[str, Any]]) -> Any:
    """A collate of the samples' ids alone (a mixture's streams hold other fields)."""
    return torch.utils.data.default_collate([{"__id__": s["__id__"]} for s in samples])


def stateful(ds: Any) -> StatefulDataLoader:
    return StatefulDataLoader(ds, batch_size=4, num_workers=2, collate_fn=ids_only)


def test_sample_ids_ride_with_each_sample_and_batch(dataset: DatasetInfo) -> None:
    ds = make(dataset.spec, shuffle_buffer=0, shuffle_shards=False)
    first = next(iter(ds))
    assert first["__id__"] == (0, 0, 0)
    ids = [sample["__id__"] for sample in make(dataset.spec)]
    assert sorted(ids) == [(0, s, i) for s in range(8) for i in range(12)]
    batches = list(make(dataset.spec, batch_size=5))
    assert batches[0]["__id__"].shape == (5, 3)
    assert batches[0]["__id__"].dtype == np.int64
    rows = np.concatenate([b["__id__"] for b in batches])
    assert sorted(map(tuple, rows.tolist())) == sorted(ids)
    # default_collate: a list of 3 int64 tensors.
    collated = next(iter(DataLoader(make(dataset.spec), batch_size=3)))
    assert [t.dtype for t in collated["__id__"]] == [torch.int64] * 3


def test_a_dataloader_run_verifies(
    dataset: DatasetInfo, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    ds = make(dataset.spec)
    loader = DataLoader(ds, batch_size=4, num_workers=2)
    with shardstream.Ledger(tmp_path, ds) as ledger:
        for epoch in range(2):
            steps = sum(1 for _ in ledger.track(loader))
            assert steps == 24, epoch
    meta = json.loads((tmp_path / "gen-000000" / "meta.json").read_text())
    assert meta["num_workers"] == 2 and meta["dataset"]["options"]["seed"] == SEED
    code, out = verify(capfd, tmp_path)
    assert code == 0, out
    assert out.count("96 of 96 samples") == 2 and "exactly once" in out, out
    code, out = verify(capfd, tmp_path, "--json")
    report = json.loads(out)
    assert report["ok"] and [e["complete"] for e in report["epochs"]] == [True, True]


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (0, 2, 1, 3), (0, 3, 2, 1)])
def test_model_parallel_processes_without_a_process_group_share_one_generation(
    dataset: DatasetInfo, tmp_path: Path, capfd: pytest.CaptureFixture[str], order: tuple[int, ...]
) -> None:
    """Four processes in model-parallel groups of two, started without
    torch.distributed, the job's first process first: one generation holds
    both data ranks' records. Before, the other process of data rank 0 made
    a second, empty generation that superseded the first, and verify said
    "no step yet"; in rank order, the last process was refused."""
    ledgers, loaders = [], []
    for process in order:
        ds = make(dataset.spec, rank=process, world_size=4, model_parallel_size=2)
        ledgers.append(shardstream.Ledger(tmp_path, ds))
        loaders.append(DataLoader(ds, batch_size=4))
    for ledger, loader in zip(ledgers, loaders, strict=True):
        with ledger:
            assert sum(1 for _ in ledger.track(loader)) == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen-000000"]
    code, out = verify(capfd, tmp_path)
    assert code == 0 and "96 of 96 samples" in out and "exactly once" in out, out


def test_what_is_not_a_generation_is_passed_over(
    dataset: DatasetInfo, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Only folders ``gen-`` and digits are generations, for verify as for
    ``Ledger``; an empty one (a run stopped between making it and writing
    its meta.json) holds nothing. Verify refused the whole ledger for a
    folder ``gen-+1`` (Rust's number parser takes a sign) or an empty
    generation."""
    ds = make(dataset.spec)
    with shardstream.Ledger(tmp_path, ds) as ledger:
        assert sum(1 for _ in ledger.track(DataLoader(ds, batch_size=4))) == 24
    (tmp_path / "gen-+1").mkdir()
    (tmp_path / "gen-+1" / "meta.json").write_text("{}")
    (tmp_path / "gen-000007").write_text("a file")
    (tmp_path / "gen-000005").mkdir()
    code, out = verify(capfd, tmp_path)
    assert code == 0 and "generations: 0 (from step 0" in out and "exactly once" in out, out
    # The next run's generation comes after the empty one.
    assert shardstream.Ledger(tmp_path, make(dataset.spec)).generation == 6


def test_a_batch_without_ids_is_refused_naming_the_option(
    dataset: DatasetInfo, tmp_path: Path
) -> None:
    ds = make(dataset.spec)
    with (
        shardstream.Ledger(tmp_path, ds) as ledger,
        pytest.raises(ValueError, match="sample_ids=True"),
    ):
        ledger.record({"__key__": ["a"]})
    with pytest.raises(ValueError, match="sample_ids=True"):
        shardstream.Ledger(tmp_path, shardstream.StreamingDataset(dataset.spec))


def test_a_batch_of_two_epochs_or_of_malformed_ids_is_refused(
    dataset: DatasetInfo, tmp_path: Path
) -> None:
    import numpy as np

    ds = make(dataset.spec)
    ledger = shardstream.Ledger(tmp_path, ds)
    ledger.record({"__id__": np.array([[0, 1, 2], [0, 1, 3]])})
    # A Rust batch is encoded when recorded: one mixing epochs is refused then.
    with pytest.raises(ValueError, match=r"step 1 has samples of epochs \[0, 1\]"):
        ledger.record({"__id__": np.array([[0, 1, 4], [1, 1, 5]])})
    # DataLoader tensors (int64 on the CPU) too.
    import torch

    with pytest.raises(ValueError, match=r"step 1 has samples of epochs \[0, 1\]"):
        ledger.record(
            {"__id__": [torch.tensor([0, 1]), torch.tensor([1, 1]), torch.tensor([4, 5])]}
        )
    # Other tensors are encoded together at the flush, and named then.
    ledger.record(
        {"__id__": [torch.tensor([0, 1])[:2:1].int(), torch.tensor([1, 1]), torch.tensor([4, 5])]}
    )
    with pytest.raises(ValueError, match=r"step 1 has samples of epochs \[0, 1\]"):
        ledger.checkpoint()
    for ids in (np.array([[0, 1]]), [np.array([0]), np.array([1, 2]), np.array([3])]):
        with pytest.raises(ValueError, match="not \\(epoch, shard, index\\)"):
            ledger.record({"__id__": ids})
    with pytest.raises(ValueError, match="no samples"):
        ledger.record({"__id__": np.empty((0, 3), dtype=np.int64)})
    # Tensor columns are checked when written: float ones are refused then.
    ledger.record({"__id__": [torch.zeros(2), torch.zeros(2), torch.ones(2)]})
    with pytest.raises(ValueError, match="not \\(epoch, shard, index\\)"):
        ledger.checkpoint()
    ledger.close()


def test_every_form_of_tensor_ids_is_recorded_alike(dataset: DatasetInfo, tmp_path: Path) -> None:
    """DataLoader ids encoded as they are recorded (three contiguous int64
    CPU tensors) and ids of other forms (int32, strided views, numpy
    columns, one (B, 3) array), queued and joined at the flush, write the
    same bytes."""
    ds = make(dataset.spec)
    epoch, shard, index = (
        torch.zeros(8, dtype=torch.int64),
        torch.arange(8) % 3,
        torch.arange(100, 108),
    )
    forms = {
        "tensors": [epoch, shard, index],
        "int32": [epoch.int(), shard.int(), index.int()],
        "strided": [torch.stack([c, c], dim=1)[:, 0] for c in (epoch, shard, index)],
        "numpy": [c.numpy() for c in (epoch, shard, index)],
        "rows": torch.stack([epoch, shard, index], dim=1).numpy(),
    }
    written = {}
    for name, ids in forms.items():
        folder = tmp_path / name
        with shardstream.Ledger(folder, ds) as ledger:
            for half in (slice(0, 4), slice(4, 8)):
                part = ids[half] if name == "rows" else [c[half] for c in ids]
                ledger.record({"__id__": part})
            ledger.epoch_end(0)
        written[name] = (folder / "gen-000000" / "rank-00000.bin").read_bytes()
    assert not forms["strided"][0].is_contiguous()
    assert len(set(written.values())) == 1, {k: len(v) for k, v in written.items()}
    assert len(written["tensors"]) == 3 * 24 + 8 * 8


def run_until(
    ds: Any, ledger: shardstream.Ledger, stop: int, save_at: set[int]
) -> dict[int, dict[str, Any]]:
    """Trains ``stop`` steps through a StatefulDataLoader, saving its state
    after each step in ``save_at``; then 'dies' (no epoch end)."""
    loader = stateful(ds)
    saved = {}
    for step, batch in enumerate(loader):
        ledger.record(batch)
        if step + 1 in save_at:
            assert ledger.checkpoint() == step + 1
            saved[step + 1] = loader.state_dict()
        if step + 1 == stop:
            break
    ledger.close()
    return saved


def resume(ds: Any, ledger: shardstream.Ledger, state: dict[str, Any]) -> int:
    loader = stateful(ds)
    loader.load_state_dict(state)
    with ledger:
        return sum(1 for _ in ledger.track(loader))


def test_a_killed_run_resumed_from_its_checkpoint_verifies(
    dataset: DatasetInfo, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    ds = make(dataset.spec)
    saved = run_until(ds, shardstream.Ledger(tmp_path, ds), 9, {6})
    ds = make(dataset.spec)
    rest = resume(ds, shardstream.Ledger(tmp_path, ds, resume_step=6), saved[6])
    assert rest == 24 - 6
    code, out = verify(capfd, tmp_path, "--json")
    assert code == 0, out
    report = json.loads(out)
    assert [g["superseded"] for g in report["generations"]] == [3, 0]
    assert report["epochs"][0]["generations"] == [0, 1]


def test_an_epoch_in_progress_is_not_called_exactly_once(
    dataset: DatasetInfo, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Verify's last line names an epoch whose end no rank recorded as in
    progress, checked for repeats only; it said "every sample exactly
    once" of a ledger whose last steps were lost."""
    ds = make(dataset.spec)
    run_until(ds, shardstream.Ledger(tmp_path, ds), 9, set())
    code, out = verify(capfd, tmp_path)
    assert code == 0 and "ok: no sample twice so far (epoch 0 in progress)" in out, out
    assert "exactly once" not in out, out
    ds = make(dataset.spec)
    loader = DataLoader(ds, batch_size=4)
    with shardstream.Ledger(tmp_path / "two", ds) as ledger:
        for epoch in range(2):
            for step, _ in enumerate(ledger.track(loader)):
                if epoch == 1 and step == 5:
                    break
    code, out = verify(capfd, tmp_path / "two")
    last = out.strip().splitlines()[-1]
    assert code == 0 and last == (
        "ok: every sample exactly once in the epochs that ended; epoch 1 in progress "
        "(no sample twice so far)"
    ), out


def test_a_resume_from_an_earlier_state_is_named(
    dataset: DatasetInfo, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    ds = make(dataset.spec)
    saved = run_until(ds, shardstream.Ledger(tmp_path, ds), 9, {4, 7})
    # The run resumes as if from step 7, with the loader state of step 4.
    ds = make(dataset.spec)
    resume(ds, shardstream.Ledger(tmp_path, ds, resume_step=7), saved[4])
    code, out = verify(capfd, tmp_path)
    assert code == 1, out
    assert "came twice in epoch 0" in out, out
    assert "step 7 of rank 0 in generation 1" in out, out
    assert "in generation 0" in out, out


def test_an_elastic_resume_onto_another_world_size_verifies(
    dataset: DatasetInfo, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    def rank_dataset(rank: int, world_size: int) -> Any:
        return make(dataset.spec, batch_size=3, rank=rank, world_size=world_size)

    # Two ranks take 5 steps each, save their states, and stop.
    states = []
    ledgers = []
    for rank in range(2):
        ds = rank_dataset(rank, 2)
        ledgers.append(shardstream.Ledger(tmp_path, ds))
        it = iter(ds)
        for _ in range(5):
            ledgers[rank].record(next(it))
        states.append(ds.state_dict())
        ledgers[rank].checkpoint()
        del it
    for ledger in ledgers:
        ledger.close()
    # Three ranks go on from step 5 with the gathered states.
    elastic = shardstream.elastic_state(*states)
    steps = []
    for rank in range(3):
        ds = rank_dataset(rank, 3)
        ds.load_state_dict(elastic)
        with shardstream.Ledger(tmp_path, ds, resume_step=5) as ledger:
            steps.append(sum(1 for _ in ledger.track(ds)))
    assert steps[0] == steps[1] == steps[2] > 0
    code, out = verify(capfd, tmp_path)
    assert code == 0, out
    assert "96 of 96 samples" in out and "ranks 2/3" in out, out


def test_skipped_steps_are_accounted(
    dataset: DatasetInfo, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    ds = make(dataset.spec, batch_size=8)
    with shardstream.Ledger(tmp_path, ds) as ledger:
        it = iter(ds)
        ledger.record(next(it))
        assert ledger.skip_steps(2, it) == 2
        assert sum(1 for _ in ledger.track(it)) == 12 - 3
    code, out = verify(capfd, tmp_path, "--json")
    assert code == 0, out
    epoch = json.loads(out)["epochs"][0]
    assert (epoch["trained"], epoch["skipped"], epoch["distinct"]) == (80, 16, 96)


def test_a_torn_last_record_is_reported_and_ignored(
    dataset: DatasetInfo, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    ds = make(dataset.spec, batch_size=8)
    with shardstream.Ledger(tmp_path, ds) as ledger:
        for _ in ledger.track(ds):
            pass
    rank_file = tmp_path / "gen-000000" / "rank-00000.bin"
    with open(rank_file, "ab") as out:
        # A record of 4 samples whose writer died after 10 bytes of them.
        out.write(struct.pack("<QQII", 99, 0, 4, 0) + bytes(10))
    code, out = verify(capfd, tmp_path)
    assert code == 0, out
    assert "cut short" in out, out
    code, out = verify(capfd, tmp_path / "nothing-here")
    assert code == 2 and "cannot list the ledger folder" in out, out


@pytest.mark.parametrize(
    ("field", "value"), [("num_workers", 2**40), ("world_size", 2**21), ("num_workers", 0)]
)
def test_a_layout_no_job_could_have_is_refused_naming_it(
    dataset: DatasetInfo, tmp_path: Path, capfd: pytest.CaptureFixture[str], field: str, value: int
) -> None:
    """A ``meta.json`` edited to a layout past the limits is a read error
    naming the field, not a plan of that many slots."""
    ds = make(dataset.spec, batch_size=8)
    with shardstream.Ledger(tmp_path, ds) as ledger:
        for _ in ledger.track(ds):
            pass
    meta_path = tmp_path / "gen-000000" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta[field] = value
    meta_path.write_text(json.dumps(meta))
    code, out = verify(capfd, tmp_path)
    assert code == 2 and "meta.json" in out and f"{field}: " in out and "must be" in out, out


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("seed", 7.0),
        ("seed", "7"),
        ("seed", -1),
        ("shuffle_shards", "yes"),
        ("remainder", 3),
        ("manifest", 5),
        ("format", ["tar"]),
        ("pack", 1),
        ("pack", "yes"),
        ("pack", {}),
        ("pack", {"seq_len": 8, "mode": "zip"}),
    ],
)
def test_a_meta_option_of_another_type_is_refused_naming_it(
    dataset: DatasetInfo,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    option: str,
    value: object,
) -> None:
    """An order option of ``meta.json`` that verify cannot read is a read
    error naming it (exit 2); before, it became the default, and the
    verdict was about another plan (a seed of ``7.0`` reported samples
    that never came; a malformed ``pack`` let verify count lost samples
    as left out past the planned sequences, and pass)."""
    ds = make(dataset.spec, batch_size=8)
    with shardstream.Ledger(tmp_path, ds) as ledger:
        for _ in ledger.track(ds):
            pass
    assert verify(capfd, tmp_path)[0] == 0
    meta_path = tmp_path / "gen-000000" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert option in meta["dataset"]["options"]
    meta["dataset"]["options"][option] = value
    meta_path.write_text(json.dumps(meta))
    code, out = verify(capfd, tmp_path)
    assert code == 2 and "meta.json" in out, out
    assert re.search(rf"option {option}(\.\w+)? is ", out), out


def test_explain_names_the_samples_of_a_step(
    dataset: DatasetInfo, capfd: pytest.CaptureFixture[str]
) -> None:
    ds = make(dataset.spec, shuffle_buffer=0)
    batches = list(DataLoader(ds, batch_size=5, num_workers=2))
    step = 3
    expected = batches[step]["__id__"]
    capfd.readouterr()
    code = run_cli(
        [
            "shardstream",
            "explain",
            dataset.spec,
            "--step",
            str(step),
            "--batch-size",
            "5",
            "--num-workers",
            "2",
            "--seed",
            str(SEED),
            "--shuffle-buffer",
            "0",
        ]
    )
    out, err = capfd.readouterr()
    assert code == 0, err
    lines = [line.split() for line in out.splitlines()[1:]]
    urls = ds.shard_list.urls
    got = [(urls.index(words[0]), int(words[2])) for words in lines]
    assert got == list(zip(expected[1].tolist(), expected[2].tolist(), strict=True)), out


def explain_ids(
    capfd: pytest.CaptureFixture[str], urls: list[str], spec: str, *args: str
) -> tuple[int, list[tuple[int, int]], str]:
    """``shardstream explain SPEC ARGS``: its exit code, the ``(shard,
    index)`` of the samples it names, and its output."""
    capfd.readouterr()
    code = run_cli(["shardstream", "explain", spec, "--seed", str(SEED), *args])
    out, err = capfd.readouterr()
    lines = [line.split() for line in out.splitlines()[1:]]
    return code, [(urls.index(words[0]), int(words[2])) for words in lines], out + err


@pytest.mark.parametrize("buffer", [{}, {"shuffle_buffer": 7, "shuffle_initial": 3}])
def test_explain_replays_the_shuffle_buffer(
    dataset: DatasetInfo, capfd: pytest.CaptureFixture[str], buffer: dict[str, int]
) -> None:
    """With a shuffle buffer (the dataset's default one, or another given to
    explain as the run had it), every step explain names is the batch the
    DataLoader hands out. The byte bound is checked by each sample's span in
    its shard (a manifest's, or found by counting a local shard), so no
    note says it is not."""
    manifest = {} if not buffer else {"manifest": False}
    ds = make(dataset.spec, **buffer, **manifest)
    batches = list(DataLoader(ds, batch_size=5, num_workers=2))
    urls = ds.shard_list.urls
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in buffer.items()]
    ask = ["--batch-size", "5", "--num-workers", "2", *(["--no-manifest"] if manifest else [])]
    reordered = False
    for step, batch in enumerate(batches):
        code, got, out = explain_ids(capfd, urls, dataset.spec, *ask, *flags, "--step", str(step))
        assert code == 0, out
        ids = batch["__id__"]
        assert got == list(zip(ids[1].tolist(), ids[2].tolist(), strict=True)), (step, out)
        assert "note" not in out, out
        unbuffered = [*ask, "--shuffle-buffer=0", "--step", str(step)]
        _, plain, _ = explain_ids(capfd, urls, dataset.spec, *unbuffered)
        reordered |= plain != got
    assert reordered
    code, _, out = explain_ids(capfd, urls, dataset.spec, *ask, *flags, "--step", str(len(batches)))
    assert code == 1 and f"takes {len(batches)} steps" in out, out


def test_explain_refuses_a_buffer_whose_byte_bound_the_spans_may_pass(
    dataset: DatasetInfo, capfd: pytest.CaptureFixture[str]
) -> None:
    """By the manifest's spans, 20 held samples may pass 20,000 bytes: which
    sample leaves early then depends on their bytes, and explain says so,
    naming ``--shuffle-buffer-bytes``."""
    urls = make(dataset.spec).shard_list.urls
    ask = ["--batch-size", "5", "--shuffle-buffer", "20", "--shuffle-buffer-bytes", "20000"]
    code, _, out = explain_ids(capfd, urls, dataset.spec, *ask, "--step", "0")
    assert code == 1 and "--shuffle-buffer-bytes" in out and "may pass 20000 bytes" in out, out


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--shuffle-initial", "0"], "--shuffle-initial"),
        (["--shuffle-buffer-bytes", "0"], "--shuffle-buffer-bytes"),
    ],
)
def test_explain_refuses_the_options_a_dataset_refuses_by_their_flags(
    dataset: DatasetInfo, capfd: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    """explain checks its dataset options as a dataset does (one builder),
    before reading anything, and names the flag."""
    with pytest.raises(ValueError, match=named.strip("-").replace("-", "_")):
        make(dataset.spec, **{named.strip("-").replace("-", "_"): 0})
    urls = make(dataset.spec).shard_list.urls
    code, _, out = explain_ids(
        capfd, urls, dataset.spec, "--batch-size", "5", "--step", "0", *flags
    )
    assert code == 1 and f"{named}: " in out and "at least 1" in out, out


@pytest.mark.parametrize("taken", [0, 3, 7])
def test_explain_from_a_saved_state_names_the_steps_of_the_resumed_run(
    dataset: DatasetInfo, tmp_path: Path, capfd: pytest.CaptureFixture[str], taken: int
) -> None:
    """``explain --state``: a ``StatefulDataLoader`` of 3 workers saved after
    ``taken`` batches; each step of the run resumed from that state is the
    one explain names from the state alone (worker turn included), and no
    step is past the rest."""
    loader = StatefulDataLoader(make(dataset.spec, shuffle_buffer=0), batch_size=5, num_workers=3)
    iterator = iter(loader)
    for _ in range(taken):
        next(iterator)
    state = loader.state_dict()
    del iterator
    saved = tmp_path / "state.json"
    saved.write_text(json.dumps(state))
    resumed = StatefulDataLoader(make(dataset.spec, shuffle_buffer=0), batch_size=5, num_workers=3)
    resumed.load_state_dict(state)
    rest = [batch["__id__"] for batch in resumed]
    urls = make(dataset.spec).shard_list.urls
    ask = ["--state", str(saved), "--batch-size", "5", "--shuffle-buffer", "0"]
    for step, ids in enumerate(rest):
        code, got, out = explain_ids(capfd, urls, dataset.spec, *ask, "--step", str(step))
        assert code == 0, out
        assert got == list(zip(ids[1].tolist(), ids[2].tolist(), strict=True)), (step, out)
    code, _, out = explain_ids(capfd, urls, dataset.spec, *ask, "--step", str(len(rest)))
    assert code == 1 and f"takes {len(rest)} steps in epoch 0 after the resume" in out, out
    if taken:
        # Another seed's plan did not hand out the state's samples: named.
        capfd.readouterr()
        other_seed = ["shardstream", "explain", dataset.spec, "--seed", "12", *ask]
        code = run_cli([*other_seed, "--step", "0"])
        assert code == 1 and "not the first ones of its slot" in capfd.readouterr().err


@pytest.mark.parametrize("buffer", [{"shuffle_buffer": 0}, {}], ids=["no-buffer", "buffer"])
def test_explain_from_a_state_saved_at_an_epochs_end_names_the_next_epoch(
    dataset: DatasetInfo, tmp_path: Path, capfd: pytest.CaptureFixture[str], buffer: dict[str, int]
) -> None:
    """A state saved once its epoch ended resumes into the next epoch from
    its start: explain names that epoch's steps, through the shuffle
    buffer if there is one. Before, it explained the finished epoch (no
    step left) or refused the buffer the epoch had left behind."""
    loader = StatefulDataLoader(make(dataset.spec, **buffer), batch_size=5, num_workers=3)
    assert sum(1 for _ in loader) > 0
    state = loader.state_dict()
    saved = tmp_path / "state.json"
    saved.write_text(json.dumps(state))
    resumed = StatefulDataLoader(make(dataset.spec, **buffer), batch_size=5, num_workers=3)
    resumed.load_state_dict(state)
    rest = [batch["__id__"] for batch in resumed]
    assert {int(ids[0][0]) for ids in rest} == {1}
    urls = make(dataset.spec).shard_list.urls
    ask = ["--state", str(saved), "--batch-size", "5"]
    ask += [] if buffer == {} else ["--shuffle-buffer", "0"]
    for step in (0, len(rest) // 2, len(rest) - 1):
        code, got, out = explain_ids(capfd, urls, dataset.spec, *ask, "--step", str(step))
        assert code == 0 and out.startswith(f"epoch 1 rank 0 step {step} after the resume"), out
        ids = rest[step]
        assert got == list(zip(ids[1].tolist(), ids[2].tolist(), strict=True)), (step, out)
    code, _, out = explain_ids(capfd, urls, dataset.spec, *ask, "--step", str(len(rest)))
    assert code == 1 and f"takes {len(rest)} steps in epoch 1 after the resume" in out, out


def test_explain_refuses_a_state_it_cannot_follow(
    dataset: DatasetInfo, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A state saved with a shuffle buffer, of a packed stream without
    ``--pack`` (its steps are sequences), with a layout no job has, or none
    at all, is refused, naming why; ``--state`` and
    ``--num-workers`` together are an error."""
    loader = stateful(make(dataset.spec, shuffle_buffer=10))
    iterator = iter(loader)
    next(iterator)
    buffered = tmp_path / "buffered.json"
    buffered.write_text(json.dumps(loader.state_dict()))
    del iterator
    docs = write_docs(tmp_path / "docs", shards=2)
    pack = shardstream.Pack(8, field="ids")
    packed = shardstream.StreamingDataset(docs, pack=pack, shuffle_buffer=0)
    # Before its first sequence: its packer holds nothing yet.
    packing = tmp_path / "packed.json"
    packing.write_text(json.dumps(packed.state_dict()))
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"steps": 3}))
    # An edited layout is named before anything is sized by it (it was a
    # Rust panic, "capacity overflow").
    edited = tmp_path / "edited.json"
    state = make(dataset.spec, shuffle_buffer=0).state_dict()
    edited.write_text(json.dumps(dict(state, num_workers=2**62)))
    for specs, path, reason in (
        ([dataset.spec], buffered, "shuffle_buffer=0"),
        (docs, packing, "a packed stream"),
        ([dataset.spec], empty, "no shardstream state"),
        ([dataset.spec], edited, f"state field num_workers: {2**62} x world_size 1 is above"),
    ):
        capfd.readouterr()
        args = ["shardstream", "explain", *specs, "--state", str(path), "--step", "0"]
        code = run_cli([*args, "--batch-size", "4"])
        assert code == 1 and reason in capfd.readouterr().err
    capfd.readouterr()
    args = ["shardstream", "explain", dataset.spec, "--state", str(empty), "--num-workers", "2"]
    assert run_cli([*args, "--step", "0", "--batch-size", "4"]) == 2
    assert "cannot be used with" in capfd.readouterr().err


def test_an_epoch_end_alone_is_written_and_ids_past_32_bits_stay_whole(
    dataset: DatasetInfo, tmp_path: Path
) -> None:
    """Records are written 8 bytes a sample while every id fits in 32 bits,
    16 otherwise; a flush of an epoch end alone writes it (the HF Trainer
    records epoch ends after its last checkpoint)."""
    import numpy as np

    from shardstream.ledger import NARROW_IDS

    ds = make(dataset.spec)
    ledger = shardstream.Ledger(tmp_path, ds)
    ledger.record({"__id__": np.array([[0, 1, 2], [0, 3, 4]])})
    ledger.checkpoint()
    ledger.epoch_end(0)
    ledger.record({"__id__": np.array([[1, 1, 2**40], [1, 2, 5]])})
    ledger.close()
    data = (ledger.path / "rank-00000.bin").read_bytes()
    header = struct.Struct("<QQII")
    step, epoch, count, kind = header.unpack_from(data, 0)
    assert (step, epoch, count, kind) == (0, 0, 2, NARROW_IDS)
    assert struct.unpack_from("<4I", data, 24) == (1, 2, 3, 4)
    at = 24 + 2 * 8
    assert header.unpack_from(data, at) == (0, 0, 0, 2)  # the epoch end
    at += 24
    assert header.unpack_from(data, at) == (1, 1, 2, 0)  # wide: an index past 2^32
    assert struct.unpack_from("<4Q", data, at + 24) == (1, 2**40, 2, 5)
    assert len(data) == at + 24 + 2 * 16


def raise_on_one(sample: dict[str, Any]) -> dict[str, Any]:
    """A transform that raises on one sample (shard 3's fifth)."""
    if sample["__key__"] == "s3-000004":
        raise ValueError("a transform's bug")
    return sample


def write_damaged_shards(root: Path) -> str:
    """4 shards of 6 samples with a json field each; shard 1's third json
    is not JSON. Their brace spec."""
    from _shardtest import write_tar

    for shard in range(4):
        members = []
        for i in range(6):
            text = b"{bad" if (shard, i) == (1, 2) else json.dumps({"i": i}).encode()
            members.append((f"s{shard}-{i:06d}.json", text))
        write_tar(root / f"s{shard}.tar", members)
    return str(root / "s{0..3}.tar")


@pytest.mark.filterwarnings("ignore::shardstream.ShardSkippedWarning")
@pytest.mark.filterwarnings("ignore::shardstream.SampleSkippedWarning")
@pytest.mark.parametrize("count_samples", [False, True])
def test_samples_left_out_under_on_error_warn_are_recorded_and_accounted(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], count_samples: bool
) -> None:
    """Under ``on_error="warn"`` a bad shard's rest (a decode error in a
    DataLoader worker) and a sample whose transform raised are left out;
    the workers record them beside the ledger (the skip's end known with
    counted shards, else "to the shard's end"), and verify accounts for
    them. Without that record the same run is named incomplete."""
    spec = write_damaged_shards(tmp_path / "data")
    ds = make(
        spec,
        decode={"json": "json"},
        on_error="warn",
        transform=raise_on_one,
        count_samples=count_samples,
    )
    ledger_dir = tmp_path / "ledger"
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=ids_only)
    with shardstream.Ledger(ledger_dir, ds) as ledger:
        trained = sum(len(batch["__id__"][0]) for batch in ledger.track(loader))
    assert trained == 24 - 4 - 1
    skips = [
        json.loads(line)
        for line in (ledger_dir / "gen-000000" / "rank-00000.skips.jsonl").read_text().splitlines()
    ]
    left_out = sorted((s["shard"], s["first"], s["end"]) for s in skips)
    assert left_out == [(1, 2, 6 if count_samples else None), (3, 4, 5)], skips
    assert {s["worker"] for s in skips} <= {0, 1} and all(s["epoch"] == 0 for s in skips)
    code, out = verify(capfd, ledger_dir, "--json")
    assert code == 0, out
    epoch = json.loads(out)["epochs"][0]
    assert (epoch["distinct"], epoch["left_out_on_error"]) == (19, 5), out
    code, out = verify(capfd, ledger_dir)
    assert "5 left out by on_error" in out and "left out samples 2 to" in out, out
    (ledger_dir / "gen-000000" / "rank-00000.skips.jsonl").unlink()
    code, out = verify(capfd, ledger_dir)
    assert code == 1 and "5 samples never came" in out, out


@pytest.mark.filterwarnings("ignore::shardstream.ShardSkippedWarning")
@pytest.mark.filterwarnings("ignore::shardstream.SampleSkippedWarning")
def test_a_closed_ledger_records_no_more_skips(tmp_path: Path) -> None:
    """After ``close()`` the dataset's later passes (an evaluation, a run
    without the ledger) no longer append their skips to the closed
    generation; a ledger made after it keeps its own log."""
    spec = write_damaged_shards(tmp_path / "data")
    ds = make(spec, decode={"json": "json"}, on_error="warn")
    skips = tmp_path / "ledger" / "gen-000000" / "rank-00000.skips.jsonl"
    with shardstream.Ledger(tmp_path / "ledger", ds) as ledger:
        assert len(list(ledger.track(DataLoader(ds, batch_size=4, collate_fn=ids_only)))) > 0
    recorded = skips.read_text()
    assert recorded and ds.skip_log is None
    assert len(list(ds)) == 24 - 4
    assert skips.read_text() == recorded
    first = shardstream.Ledger(tmp_path / "first", ds)
    second = shardstream.Ledger(tmp_path / "second", ds)
    first.close()
    assert ds.skip_log is not None and "second" in ds.skip_log.path
    second.close()
    assert ds.skip_log is None


@pytest.mark.filterwarnings("ignore::shardstream.ShardSkippedWarning")
@pytest.mark.filterwarnings("ignore::shardstream.SampleSkippedWarning")
@pytest.mark.parametrize("policy", ["stop", "restart", "continue"])
def test_a_mix_whose_stream_left_samples_out_under_warn_verifies(
    dataset: DatasetInfo, tmp_path: Path, capfd: pytest.CaptureFixture[str], policy: str
) -> None:
    """A ``Mix`` whose second stream skips a bad shard's rest and a
    transform's sample: the skips are recorded as the mixture's ids (its
    pass over the stream), and verify accounts for them."""
    spec = write_damaged_shards(tmp_path / "data")
    good = make(dataset.spec, shuffle_buffer=5)
    damaged = make(spec, decode={"json": "json"}, on_error="warn", transform=raise_on_one)
    mix = shardstream.Mix([good, damaged], [0.7, 0.3], policy=policy, seed=7)
    ledger_dir = tmp_path / "ledger"
    loader = DataLoader(mix, batch_size=4, num_workers=2, collate_fn=ids_only)
    with shardstream.Ledger(ledger_dir, mix) as ledger:
        steps = sum(1 for _ in ledger.track(loader))
    assert steps > 0
    skips = (ledger_dir / "gen-000000" / "rank-00000.skips.jsonl").read_text().splitlines()
    # The damaged stream's shards are numbered after the good stream's 8.
    assert {json.loads(line)["shard"] % 12 for line in skips} <= {8 + 1, 8 + 3}, skips
    code, out = verify(capfd, ledger_dir, "--json")
    assert code == 0, out
    epoch = json.loads(out)["epochs"][0]
    assert epoch["complete"] and epoch["coverage_checked"], out
    assert epoch["left_out_on_error"] > 0, out
    (ledger_dir / "gen-000000" / "rank-00000.skips.jsonl").unlink()
    code, out = verify(capfd, ledger_dir)
    assert code == 1, out


def mix_of(dataset: DatasetInfo, other: DatasetInfo, policy: str) -> shardstream.Mix:
    a = make(dataset.spec, shuffle_buffer=5)
    b = shardstream.StreamingDataset(other.spec, seed=SEED + 1, sample_ids=True, shuffle_buffer=3)
    return shardstream.Mix([a, b], [0.7, 0.3], policy=policy, seed=7)


def test_a_mix_whose_weights_change_between_epochs_verifies(
    dataset: DatasetInfo,
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """``set_weights`` between epochs (a curriculum), in persistent
    workers: the ledger writes each epoch's weights, and verify replays each
    epoch with its own; a later run (a new generation) with other weights
    verifies too."""
    from _shardtest import write_uneven_dataset

    other = write_uneven_dataset(tmp_path_factory.mktemp("other"), (7, 9), prefix="o")
    mix = mix_of(dataset, other, "stop")
    loader = StatefulDataLoader(
        mix, batch_size=4, num_workers=2, collate_fn=ids_only, persistent_workers=True
    )
    steps = 0
    with shardstream.Ledger(tmp_path, mix) as ledger:
        for weights in ([0.7, 0.3], [0.2, 0.8]):
            mix.set_weights(weights)
            steps += sum(1 for _ in ledger.track(loader))
    mix = mix_of(dataset, other, "stop")
    mix.set_epoch(2)
    mix.set_weights([0.5, 0.5])
    with shardstream.Ledger(tmp_path, mix, resume_step=steps) as later:
        assert sum(1 for _ in later.track(stateful(mix))) > 0
    code, out = verify(capfd, tmp_path, "--json")
    assert code == 0, out
    epochs = json.loads(out)["epochs"]
    assert [e["epoch"] for e in epochs] == [0, 1, 2], out
    assert all(e["complete"] and e["coverage_checked"] for e in epochs), out
    # The weights changed what each epoch took.
    assert len({e["expected"] for e in epochs}) == 3, out


@pytest.mark.parametrize("policy", ["stop", "restart", "continue"])
def test_a_mix_killed_and_resumed_verifies_and_a_wrong_resume_is_named(
    dataset: DatasetInfo,
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    policy: str,
) -> None:
    """A ``Mix`` ledger: killed at step 9 and resumed from its step-6
    checkpoint, the job verifies against the mixture's plan (a restart's
    second pass included); resumed instead with the step-3 state as if it
    were step 6's, the repeat is named with its stream and pass."""
    from _shardtest import write_uneven_dataset

    other = write_uneven_dataset(tmp_path_factory.mktemp("other"), (7, 9), prefix="o")
    good, bad = tmp_path / "good", tmp_path / "bad"
    for ledger_dir in (good, bad):
        mix = mix_of(dataset, other, policy)
        saved = run_until(mix, shardstream.Ledger(ledger_dir, mix, num_workers=2), 9, {3, 6})
        mix = mix_of(dataset, other, policy)
        state = saved[6] if ledger_dir == good else saved[3]
        resume(mix, shardstream.Ledger(ledger_dir, mix, resume_step=6), state)
    code, out = verify(capfd, good, "--json")
    assert code == 0, out
    epoch = json.loads(out)["epochs"][0]
    assert epoch["complete"] and epoch["coverage_checked"], out
    assert epoch["distinct"] + epoch["padded"] == epoch["expected"] > 0, out
    if policy == "restart":
        # The shorter stream is read again: more samples than the two hold.
        assert epoch["expected"] > 96 + 16, out
    code, out = verify(capfd, bad)
    assert code == 1 and "came twice in epoch 0" in out and "(stream " in out, out

"""The ``shardstream`` command line, run as a subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest
from _shardtest import read_tar_samples
from s3_server import BUCKET
from s3_server import s3_config as config

from shardstream import ShardStreamError, StreamingDataset, _core

SCRIPT = Path(sys.executable).with_name("shardstream")
LAUNCHERS = {
    "module": [sys.executable, "-m", "shardstream"],
    "script": [str(SCRIPT)],
}

SLOT_LINE = re.compile(r"^rank (\d+) worker (\d+): (\d+) shards, (\d+) bytes$")


def run(launcher: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LAUNCHERS[launcher], *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(params=sorted(LAUNCHERS))
def launcher(request) -> str:
    if request.param == "script":
        assert SCRIPT.is_file(), f"console script missing next to {sys.executable}"
    return request.param


# --------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------


def parse_inspect(stdout: str) -> tuple[list[tuple[str, list[tuple[str, int]]]], str]:
    lines = stdout.rstrip("\n").split("\n")
    rows = []
    for line in lines[:-1]:
        key, _, fields = line.partition("\t")
        assert _, f"no tab in {line!r}"
        parsed = []
        for item in fields.split(" "):
            name, _, size = item.rpartition(":")
            parsed.append((name, int(size)))
        rows.append((key, parsed))
    return rows, lines[-1]


def test_inspect_lists_every_sample(launcher, dataset):
    path = dataset.paths[2]
    proc = run(launcher, "inspect", path)
    assert proc.returncode == 0, proc.stderr
    rows, totals = parse_inspect(proc.stdout)
    expected = read_tar_samples(path)
    assert rows == [
        (s.key, [(name, len(value)) for name, value in s.fields.items()]) for s in expected
    ]
    assert totals.startswith(f"{len(expected)} samples, ")
    field_bytes = sum(len(v) for s in expected for v in s.fields.values())
    numbers = [int(n) for n in re.findall(r"\d+", totals)]
    assert field_bytes in numbers
    assert path.stat().st_size in numbers


def test_inspect_limit(launcher, dataset):
    path = dataset.paths[0]
    expected = read_tar_samples(path)
    limit = 3
    assert len(expected) > limit
    proc = run(launcher, "inspect", path, "--limit", limit)
    assert proc.returncode == 0, proc.stderr
    rows, totals = parse_inspect(proc.stdout)
    assert [key for key, _ in rows] == [s.key for s in expected[:limit]]
    # The totals still cover the whole shard.
    assert totals.startswith(f"{len(expected)} samples, ")


def test_inspect_file_url(dataset):
    path = dataset.paths[1]
    proc = run("module", "inspect", f"file://{path}")
    assert proc.returncode == 0, proc.stderr
    rows, _ = parse_inspect(proc.stdout)
    assert [key for key, _ in rows] == [s.key for s in read_tar_samples(path)]


def test_inspect_missing_shard(launcher, tmp_path):
    missing = tmp_path / "no-such-shard.tar"
    proc = run(launcher, "inspect", missing)
    assert proc.returncode == 1
    assert "error:" in proc.stderr
    assert str(missing) in proc.stderr
    assert "samples" not in proc.stdout


def test_inspect_not_a_tar(tmp_path):
    path = tmp_path / "text.tar"
    path.write_bytes(b"plain text, not an archive\n" * 50)
    proc = run("module", "inspect", path)
    assert proc.returncode == 1
    assert "error:" in proc.stderr and "not a tar archive" in proc.stderr


@pytest.mark.parametrize("store", ["http", "s3"])
def test_inspect_of_a_remote_shard_gives_its_size(store, request, dataset):
    # A remote shard named outright is resolved without a request: its size
    # is asked for, not printed as 0.
    path = dataset.paths[0]
    if store == "http":
        url = request.getfixturevalue("http").url(path.name)
        options: list[str] = []
    else:
        s3 = request.getfixturevalue("s3")
        request.getfixturevalue("s3_credentials")
        url = request.getfixturevalue("s3_dataset")["urls"][0]
        options = ["--s3-endpoint-url", s3.endpoint_url, "--s3-region", "us-east-1"]
        options.append("--s3-path-style")
    proc = run("module", *options, "inspect", url)
    assert proc.returncode == 0, proc.stderr
    rows, totals = parse_inspect(proc.stdout)
    assert len(rows) == len(read_tar_samples(path))
    assert f" {path.stat().st_size} bytes in the shard" in totals, totals


def test_usage_errors_exit_nonzero():
    for args in (["inspect"], ["frobnicate"], ["plan"]):
        proc = run("module", *args)
        assert proc.returncode not in (0, 1), (args, proc.returncode)
        assert proc.stderr.strip(), args


def test_version():
    proc = run("module", "--version")
    assert proc.returncode == 0, proc.stderr
    assert _core.__version__ in proc.stdout


# --------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------


def parse_plan(stdout: str) -> tuple[str, list[tuple[int, int, int, int, list[str]]]]:
    lines = stdout.rstrip("\n").split("\n")
    header, slots = lines[0], []
    for line in lines[1:]:
        if line.startswith("  "):
            assert slots, f"shard line before any slot: {line!r}"
            slots[-1][4].append(line.strip())
            continue
        match = SLOT_LINE.match(line)
        assert match, f"unexpected plan line {line!r}"
        rank, worker, count, size = map(int, match.groups())
        slots.append((rank, worker, count, size, []))
    return header, slots


@pytest.mark.parametrize(
    ("world_size", "workers", "seed", "epoch", "shuffle"),
    # Plans by bytes (--no-count) are for one rank; several need sample counts.
    [(1, 1, 0, 0, True), (1, 4, 0, 0, True), (1, 6, 17, 4, True), (1, 3, 5, 1, False)],
)
def test_plan_matches_plan_epoch(launcher, dataset, world_size, workers, seed, epoch, shuffle):
    args = ["plan", dataset.spec, "--world-size", world_size, "--workers", workers]
    args += ["--seed", seed, "--epoch", epoch, "--no-count"]
    if not shuffle:
        args.append("--no-shuffle")
    proc = run(launcher, *args)
    assert proc.returncode == 0, proc.stderr
    header, slots = parse_plan(proc.stdout)
    assert str(len(dataset.paths)) in header
    expected = _core.plan_epoch(
        dataset.sizes,
        seed=seed,
        epoch=epoch,
        world_size=world_size,
        num_workers=workers,
        shuffle_shards=shuffle,
    )
    assert len(slots) == world_size * workers
    size_of = dict(zip(dataset.urls, dataset.sizes, strict=True))
    for slot, (rank, worker, count, size, urls) in enumerate(slots):
        assert (rank, worker) == divmod(slot, workers)
        assert count == len(urls)
        assert size == sum(size_of[u] for u in urls)
        assert urls == [dataset.urls[i] for i in expected[slot]]
    listed = [u for *_, urls in slots for u in urls]
    assert sorted(listed) == sorted(dataset.urls)


def test_plan_epochs_differ(dataset):
    outputs = [
        run("module", "plan", dataset.spec, "--epoch", e, "--seed", 3, "--no-count").stdout
        for e in (0, 1)
    ]
    orders = [parse_plan(out)[1][0][4] for out in outputs]
    assert sorted(orders[0]) == sorted(orders[1]) == sorted(dataset.urls)
    assert orders[0] != orders[1]


def test_plan_no_shuffle_lists_in_order(dataset):
    proc = run("module", "plan", dataset.spec, "--no-shuffle", "--epoch", "9", "--no-count")
    assert proc.returncode == 0, proc.stderr
    _, slots = parse_plan(proc.stdout)
    assert len(slots) == 1
    assert slots[0][4] == dataset.urls


def test_plan_directory(tmp_path, dataset):
    for i in range(3):
        (tmp_path / f"s{i}.tar").write_bytes(dataset.paths[i].read_bytes())
    proc = run("module", "plan", tmp_path, "--workers", "2", "--no-count")
    assert proc.returncode == 0, proc.stderr
    _, slots = parse_plan(proc.stdout)
    listed = sorted(u for *_, urls in slots for u in urls)
    assert listed == sorted(f"{tmp_path}/s{i}.tar" for i in range(3))


def test_plan_of_missing_files_is_an_error(tmp_path):
    proc = run("module", "plan", f"{tmp_path}/shard-{{0..4}}.tar")
    assert proc.returncode == 1
    assert "not found" in proc.stderr and f"{tmp_path}/shard-0.tar" in proc.stderr


def test_plan_counts_local_tar_shards_for_equal_ranks(dataset):
    """Without a manifest, local tar shards are counted from their headers:
    every rank gets the same number of samples, as with a manifest."""
    proc = run("module", "plan", dataset.spec, "--world-size", "3", "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    total = len(dataset.samples)
    assert f"{total // 3} samples per rank" in proc.stdout
    assert "counted from the local shards" in proc.stdout
    per_slot = [int(m) for m in re.findall(r": \d+ pieces, (\d+) samples", proc.stdout)]
    assert len(per_slot) == 6
    assert [per_slot[0] + per_slot[1], per_slot[2] + per_slot[3], per_slot[4] + per_slot[5]] == [
        total // 3
    ] * 3


def test_plan_of_several_ranks_without_counts_is_an_error(dataset):
    proc = run("module", "plan", dataset.spec, "--world-size", "2", "--no-count")
    assert proc.returncode == 1
    assert "shardstream index" in proc.stderr and "world_size 2" in proc.stderr


def test_plan_bad_spec_and_bad_world_size(dataset):
    proc = run("module", "plan", "shard-{1..")
    assert proc.returncode == 1 and "error:" in proc.stderr
    proc = run("module", "plan", dataset.spec, "--world-size", "0")
    assert proc.returncode == 1 and "error:" in proc.stderr and "world_size" in proc.stderr


# --------------------------------------------------------------------------
# index
# --------------------------------------------------------------------------


def index_of(*args: str | Path) -> tuple[subprocess.CompletedProcess[str], dict | None]:
    """Runs ``python -m shardstream ARGS`` (ending in ``-o OUT``) and reads
    the manifest it wrote, if it succeeded."""
    proc = run("module", *args)
    manifest = json.loads(Path(args[-1]).read_text()) if proc.returncode == 0 else None
    return proc, manifest


def dataset_error(spec: str | list[str], **options: Any) -> str:
    """The message ``StreamingDataset(spec)`` raises."""
    with pytest.raises(ShardStreamError) as raised:
        StreamingDataset(spec, **options)
    return str(raised.value)


def test_index_resolves_specs_as_datasets_do(dataset, tmp_path):
    """A brace range, a directory, and a list of a brace list and a range
    give every shard, in the dataset's order, each sample counted."""
    root = dataset.paths[0].parent
    names = [p.name for p in dataset.paths]
    stems = ",".join(Path(n).stem for n in names[:2])
    rest = f"{Path(names[2]).stem[:-1]}{{{Path(names[2]).stem[-1]}..{Path(names[-1]).stem[-1]}}}"
    specs = [
        [dataset.spec],
        [f"{root}/"],
        [f"{root}/{{{stems}}}.tar", f"{root}/{rest}.tar"],
    ]
    for i, spec in enumerate(specs):
        proc, manifest = index_of("index", *spec, "-o", tmp_path / f"m{i}.json")
        assert proc.returncode == 0, (spec, proc.stderr)
        assert manifest is not None
        assert [Path(e["url"]).name for e in manifest["shards"]] == names, spec
        assert sum(e["samples"] for e in manifest["shards"]) == len(dataset.keys)
        assert f"indexed {len(names)} shards" in proc.stdout


def test_index_refuses_what_datasets_refuse_with_their_errors(dataset, tmp_path):
    root = dataset.paths[0].parent
    n = len(dataset.paths)
    (tmp_path / "empty").mkdir()
    first = str(dataset.paths[0])
    bad: list[list[str]] = [
        [f"{root}/shard-{{1.."],
        ["ftp://host/a.tar"],
        [f"{root}/shard-{{000000..{n:06d}}}.tar"],  # the last one is missing
        [f"{tmp_path}/empty/"],
        [first, first.replace(str(root), f"{root}/.")],  # listed twice
    ]
    out = tmp_path / "m.json"
    for spec in bad:
        proc, _ = index_of("index", *spec, "-o", out)
        assert proc.returncode == 1, spec
        expected = dataset_error(spec if len(spec) > 1 else spec[0])
        assert proc.stderr.strip() == f"error: {expected}", spec
        assert not out.exists()


def test_index_of_a_parquet_file_says_it_needs_token_counts(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"a": [1, 2, 3]}), path)
    proc, _ = index_of("index", path, "-o", tmp_path / "m.json")
    assert proc.returncode == 1
    assert str(path) in proc.stderr, proc.stderr
    assert "--format parquet --count-tokens FIELD" in proc.stderr, proc.stderr


@pytest.mark.usefixtures("s3_credentials")
def test_index_of_an_s3_prefix_and_range(s3, s3_dataset, tmp_path):
    endpoint = ["--s3-endpoint-url", s3.endpoint_url, "--s3-path-style", "--s3-region", "us-east-1"]
    urls = s3_dataset["urls"]
    names = [u.rsplit("/", 1)[1] for u in urls]
    stem = Path(names[0]).stem[:-1]
    first, last = Path(names[0]).stem[-1], Path(names[-1]).stem[-1]
    for i, spec in enumerate(
        [f"s3://{BUCKET}/audio/", f"s3://{BUCKET}/audio/{stem}{{{first}..{last}}}.tar"]
    ):
        proc, manifest = index_of(*endpoint, "index", spec, "-o", tmp_path / f"m{i}.json")
        assert proc.returncode == 0, proc.stderr
        assert manifest is not None
        assert [e["url"] for e in manifest["shards"]] == urls
        assert [e["size"] for e in manifest["shards"]] == [s3_dataset["sizes"][u] for u in urls]
        assert sum(e["samples"] for e in manifest["shards"]) == len(s3_dataset["expected"])
    spec = f"s3://{BUCKET}/nothing-here/"
    proc, _ = index_of(*endpoint, "index", spec, "-o", tmp_path / "none.json")
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: {dataset_error(spec, s3=config(s3))}"


def copy_dataset(dataset, root: Path) -> list[Path]:
    """The dataset's shards copied into ``root`` (times kept)."""
    import shutil

    root.mkdir()
    return [Path(shutil.copy2(path, root / path.name)) for path in dataset.paths]


def test_index_reads_shards_at_once_into_the_same_manifest(dataset, tmp_path):
    """Shards spread over 1, 3 or 16 streams give the same manifest, in the
    listed order, and leave no journal behind."""
    out = dataset.paths[0].parent / "m.json"
    manifests = []
    for jobs in (1, 3, 16):
        proc, manifest = index_of("index", dataset.spec, "--jobs", str(jobs), "-o", out)
        assert proc.returncode == 0, proc.stderr
        manifests.append(manifest)
        assert not out.with_name("m.json.partial").exists()
    out.unlink()
    assert manifests[0] == manifests[1] == manifests[2]
    shards = manifests[0]["shards"]
    assert [e["url"] for e in shards] == [p.name for p in dataset.paths]
    for entry, path in zip(shards, dataset.paths, strict=True):
        assert entry["samples"] == len(read_tar_samples(path))
    proc = run("module", "index", dataset.spec, "--jobs", "0", "-o", tmp_path / "x.json")
    assert proc.returncode == 2 and "--jobs" in proc.stderr, proc.stderr


def test_an_interrupted_index_resumes_without_reading_its_indexed_shards(dataset, tmp_path):
    """A run stopped by a bad shard leaves a journal of the shards it had
    indexed; the next run takes them from it without reading them (their
    bytes are garbage by then, with the same size and time, and would fail),
    reads a shard that changed since (another size) again, skips a cut last
    line, and writes the manifest an uninterrupted run writes."""
    paths = copy_dataset(dataset, tmp_path / "shards")
    spec = f"{paths[0].parent}/shard-{{000000..{len(paths) - 1:06d}}}.tar"
    out = paths[0].parent / "manifest.json"
    journal = out.with_name("manifest.json.partial")
    proc, reference = index_of("index", spec, "-o", out)
    assert proc.returncode == 0, proc.stderr
    out.unlink()

    # Shard 5 unreadable: one stream reads the shards in listed order and
    # stops there, with shards 0..3 journaled (shard 4's end is not known
    # before the error).
    original = paths[5].read_bytes()
    paths[5].write_bytes(b"\xff" * len(original))
    proc = run("module", "index", spec, "--jobs", "1", "-o", out)
    assert proc.returncode == 1 and paths[5].name in proc.stderr, proc.stderr
    assert not out.exists()
    lines = journal.read_text().splitlines()
    assert [json.loads(line)["url"] for line in lines] == [p.name for p in paths[:4]]

    paths[5].write_bytes(original)
    for path in paths[:4]:  # what was indexed: garbage now, same size and time
        stat = path.stat()
        path.write_bytes(b"\xff" * stat.st_size)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with journal.open("a") as file:
        file.write('{"url": "shard-0000')  # a line cut by the interruption
    # Shard 1 changed since: another size, so read again (zeros after a
    # tar's end are more end-of-archive padding, the same samples).
    paths[1].write_bytes(original_bytes(dataset, 1) + bytes(1024))
    proc, resumed = index_of("index", spec, "--jobs", "2", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert "(3 from the journal of an earlier run)" in proc.stdout, proc.stdout
    assert not journal.exists()
    assert resumed is not None
    expected = reference["shards"]
    expected[1] = dict(expected[1], size=expected[1]["size"] + 1024)
    for rewritten in (1, 5):
        expected[rewritten]["mtime_ns"] = resumed["shards"][rewritten]["mtime_ns"]
    assert resumed["shards"] == expected


def test_an_interrupted_write_stops_and_leaves_no_partial_shard(tmp_path):
    """Before, Ctrl-C made the command exit while its writing thread was
    killed mid-shard, its ``.partial`` file left behind (and, called in a
    process that goes on, the write went on to its end)."""
    src = tmp_path / "src"
    src.mkdir()
    # 64 MB that gzip does not shrink: seconds of compressing, so that the
    # interrupt (seen within 0.1 s) comes while the first shard is open.
    for i in range(4000):
        (src / f"{i:05d}.bin").write_bytes(os.urandom(16 << 10))
    out = tmp_path / "out"
    pattern = f"{out}/s-%03d.tar.gz"
    proc = subprocess.Popen(
        [
            *LAUNCHERS["module"],
            "write",
            str(src),
            pattern,
            "--max-count",
            "1000",
            "--compression",
            "gz",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A run started in the background of a shell without job control
        # inherits SIGINT ignored, and Python then installs no handler.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 60
        while not (out.is_dir() and any(n.endswith(".partial") for n in os.listdir(out))):
            assert proc.poll() is None and time.monotonic() < deadline, "no shard was begun"
            time.sleep(0.002)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert stderr.strip() == "shardstream: interrupted", stderr
    names = sorted(os.listdir(out))
    assert not [n for n in names if n.endswith(".partial")], names
    shards = [n for n in names if n.endswith(".tar.gz")]
    assert len(shards) < 4, "the write stopped before its end"
    # What is left is whole: the completed shards, each in the manifest
    # (written as each shard completes: none if none did).
    manifest = out / "manifest.json"
    listed = json.loads(manifest.read_text())["shards"] if manifest.exists() else []
    assert [e["url"] for e in listed] == shards
    for name in shards:
        with tarfile.open(out / name, "r:gz") as tar:
            assert len(tar.getmembers()) == 1000


def original_bytes(dataset, index: int) -> bytes:
    return dataset.paths[index].read_bytes()


def test_index_refuses_an_output_it_cannot_write_before_reading_a_shard(dataset, tmp_path):
    """A directory, a path whose folder is missing, and one in a folder
    that cannot be written are refused at once, naming the option and what
    is wrong, before any shard is read (a bad shard in the spec is not
    what fails), and nothing is left behind."""
    paths = copy_dataset(dataset, tmp_path / "shards")
    paths[-1].write_bytes(b"\xff" * 4096)  # would fail the run if it were read
    spec = f"{paths[0].parent}/"
    out = tmp_path / "out"
    out.mkdir()
    for given in (f"{out}/", str(out)):
        proc = run("module", "index", spec, "-o", given)
        assert proc.returncode == 1, proc.stderr
        assert "--output" in proc.stderr and "is a directory" in proc.stderr, proc.stderr
        assert f"{out}/manifest.json" in proc.stderr, proc.stderr
        assert paths[-1].name not in proc.stderr, proc.stderr
    assert list(out.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "shards"]
    missing = tmp_path / "missing" / "manifest.json"
    proc = run("module", "index", spec, "-o", missing)
    assert proc.returncode == 1, proc.stderr
    assert "--output" in proc.stderr and f"{missing.parent} does not exist" in proc.stderr
    assert not missing.parent.exists()
    # /sys cannot be written, even by root.
    proc = run("module", "index", spec, "-o", "/sys/manifest.json")
    assert proc.returncode == 1, proc.stderr
    assert "--output" in proc.stderr and "cannot write in /sys" in proc.stderr, proc.stderr
    assert sorted(p.name for p in paths[0].parent.iterdir()) == [p.name for p in paths]

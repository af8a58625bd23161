"""Correctness of the peer benchmark (benches/peers/peers_bench.py), not speed:
its generators, its epoch runner's accounting and its report, on tiny data."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from s3_server import S3Server

BENCH = Path(__file__).resolve().parents[2] / "benches" / "peers" / "peers_bench.py"
PROFILES = ("audio", "small", "jpeg")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """The benchmark script, imported as a module."""
    spec = importlib.util.spec_from_file_location("peers_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["peers_bench"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def profiles(bench: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every profile at its --quick size, made by the benchmark's generator."""
    root = tmp_path_factory.mktemp("peers")
    return {name: bench.generate(name, root, quick=True) for name in PROFILES}


@pytest.mark.parametrize("profile", PROFILES)
def test_generator_is_deterministic_and_meta_matches_the_tars(
    bench: ModuleType, profiles: dict[str, Path], tmp_path: Path, profile: str
) -> None:
    data = profiles[profile]
    again = bench.generate(profile, tmp_path, quick=True)
    tars = bench.tar_paths(data)
    shards, per_shard = bench.PROFILES[profile]["quick"]
    assert len(tars) == shards
    assert [p.read_bytes() for p in tars] == [p.read_bytes() for p in bench.tar_paths(again)]

    meta = bench.load_meta(data)
    samples = [s for path in tars for s in bench.read_tar_samples(path)]
    assert meta["keys"] == [s["__key__"] for s in samples]
    assert len(set(meta["keys"])) == shards * per_shard
    assert meta["payload_bytes"] == sum(
        len(v) for s in samples for k, v in s.items() if k != "__key__"
    )
    if profile == "small":
        assert meta["fields"] == ["cls", "txt"]
        assert {len(s["txt"]) for s in samples} == {bench.SMALL_TEXT_BYTES}
        assert {int(s["cls"]) for s in samples} <= set(range(10))
    elif profile == "jpeg":
        from PIL import Image

        assert meta["fields"] == ["cls", "jpg"]
        assert all(30_000 < len(s["jpg"]) < 60_000 for s in samples)
        for sample in samples:
            with Image.open(io.BytesIO(sample["jpg"])) as image:
                assert (image.format, image.size) == ("JPEG", bench.JPEG_SIZE)
        # The label is left out of the sum (HF datasets hands it out parsed).
        summed = [
            t for s in samples for name, t in _bytes_of(s) if name not in bench.UNSUMMED_FIELDS
        ]
        assert meta["byte_sum"] == sum(summed)
    else:
        assert meta["fields"] == ["json", "wav"]
        assert all(s["wav"][:4] == b"RIFF" and s["wav"][8:12] == b"WAVE" for s in samples)


def _bytes_of(sample: dict[str, Any]) -> Iterator[tuple[str, int]]:
    """Each bytes field's name and the sum of its bytes."""
    for name, value in sample.items():
        if isinstance(value, bytes):
            yield name, sum(value)


@pytest.mark.parametrize("change", ["a byte of an image", "the labels parsed"])
def test_a_touched_profile_refuses_altered_bytes(
    bench: ModuleType, profiles: dict[str, Path], monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """The jpeg profile's consumer sums every byte but the label's: a reader
    handing out one altered byte of an image fails the run; one handing
    out each label parsed into a number (as HF datasets does) does not."""
    from torch.utils.data import IterableDataset

    data = profiles["jpeg"]
    tars = bench.tar_paths(data)

    class Altering(IterableDataset):
        def __iter__(self) -> Iterator[dict[str, Any]]:
            for i, sample in enumerate(s for path in tars for s in bench.read_tar_samples(path)):
                if change == "the labels parsed":
                    sample["cls"] = int(sample["cls"])
                elif i == 3:
                    sample["jpg"] = sample["jpg"][:-1] + bytes([(sample["jpg"][-1] + 1) % 256])
                yield sample

    monkeypatch.setattr(bench, "import_library", lambda library: None)
    monkeypatch.setattr(bench, "library_version", lambda library: "0")
    monkeypatch.setattr(
        bench,
        "make_dataset_for",
        lambda library, data, cache: (Altering(), {"batch_size": 32, "collate_fn": list}),
    )
    if change == "the labels parsed":
        result = bench.run_epoch(data, "altering", 0)
        assert result["byte_sum"] == bench.load_meta(data)["byte_sum"]
        return
    with pytest.raises(RuntimeError, match="altered"):
        bench.run_epoch(data, "altering", 0)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("library", ["shardstream", "shardstream (Rust batches)"])
@pytest.mark.parametrize("profile", PROFILES)
def test_shardstream_epoch_is_exactly_once_and_reads_every_byte_once(
    bench: ModuleType, profiles: dict[str, Path], profile: str, library: str, num_workers: int
) -> None:
    data = profiles[profile]
    result = bench.run_epoch(data, library, num_workers)
    shards, per_shard = bench.PROFILES[profile]["quick"]
    assert result["samples"] == result["expected_samples"] == shards * per_shard
    assert (result["duplicates"], result["missing"], result["unexpected"]) == (0, 0, 0)
    # One I/O report per process that iterated: the main process, or each worker.
    assert len(result["iteration_io"]) == max(num_workers, 1)
    disk = sum(p.stat().st_size for p in bench.tar_paths(data))
    assert result["disk_bytes"] == disk
    assert result["shardstream_bytes_read"] == disk
    # Local shards are memory-mapped: read() hands over none of their bytes,
    # so `rchar` sees only the small reads around them (pipes, /proc).
    assert result["rchar_bytes"] < 0.05 * disk
    assert result["payload_bytes"] == bench.load_meta(data)["payload_bytes"]
    assert result["seconds"] > 0 and result["cpu_seconds"] > 0


def test_cold_cache_run_counts_the_same_samples(
    bench: ModuleType, profiles: dict[str, Path]
) -> None:
    result = bench.run_epoch(profiles["audio"], "shardstream", 2, cold=True)
    assert result["cold_cache"] is True
    assert (result["duplicates"], result["missing"]) == (0, 0)
    # The dataset left the page cache first, so the epoch read it from the
    # device (the workers' counters included).
    assert result["device_read_bytes"] >= 0.9 * result["disk_bytes"], result


def test_duplicates_and_missing_samples_are_counted(
    bench: ModuleType, profiles: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that reads the first shard twice and skips the last one."""
    from torch.utils.data import IterableDataset

    data = profiles["small"]
    tars = bench.tar_paths(data)

    class Faulty(IterableDataset):
        def __iter__(self) -> Iterator[dict[str, Any]]:
            for path in [tars[0], *tars[:-1]]:
                yield from bench.read_tar_samples(path)

    monkeypatch.setattr(bench, "import_library", lambda library: None)
    monkeypatch.setattr(bench, "library_version", lambda library: "0")
    monkeypatch.setattr(
        bench,
        "make_dataset_for",
        lambda library, data, cache: (Faulty(), {"batch_size": 32, "collate_fn": list}),
    )
    result = bench.run_epoch(data, "faulty", 0)
    _, per_shard = bench.PROFILES["small"]["quick"]
    assert result["duplicates"] == per_shard
    assert result["missing"] == per_shard
    assert result["samples"] == len(tars) * per_shard


def test_report_medians_and_ratios(bench: ModuleType) -> None:
    def run(library: str, seconds: float, cold: bool = False) -> dict[str, Any]:
        return {
            "library": library,
            "version": "1",
            "samples": 1000,
            "expected_samples": 1000,
            "payload_bytes": 10**9,
            "disk_bytes": 2 * 10**9,
            "seconds": seconds,
            "cpu_seconds": 2 * seconds,
            "rss_main_mb": 500.0,
            "rss_worker_mb": 400.0,
            "duplicates": 0,
            "missing": 1 if cold else 0,
            "unexpected": 0,
            "rchar_bytes": 2 * 10**9,
            "device_read_bytes": 3 * 10**9,
            "cold_cache": cold,
        }

    results = {
        ("small", 2, "webdataset"): bench.summarize([run("webdataset", s) for s in (4, 2, 3)]),
        ("small", 2, "shardstream"): bench.summarize(
            [run("shardstream", 10, cold=True), *(run("shardstream", s) for s in (1, 2, 1))]
        ),
    }
    ours = results[("small", 2, "shardstream")]
    assert ours["samples_per_s"] == 1000 and ours["runs"] == 3
    assert ours["mb_per_s"] == 1000 and ours["cpu_s_per_gb"] == 2
    assert ours["read_amplification"] == 1 and ours["device_amplification"] == 1.5
    assert ours["missing"] == 1  # the worst run, cold ones included
    table = bench.markdown(results, "# title")
    row = next(line for line in table.splitlines() if "| shardstream |" in line)
    assert "| 1,000 | 3.00x |" in row and "| 2.0 | 0.33x |" in row
    assert "| 0 / 1 | 1.00 / 1.50 |" in row
    base = next(line for line in table.splitlines() if "| webdataset |" in line)
    assert base.endswith("| 1.00 / - |")


def test_best_peer_ratio_pairs_the_runs_of_each_repetition(bench: ModuleType) -> None:
    def runs(library: str, seconds: list[float]) -> list[dict[str, Any]]:
        cold = {"library": library, "samples": 1200, "seconds": 1.0, "cold_cache": True}
        timed = [
            {"library": library, "samples": 1200, "seconds": s, "cold_cache": False}
            for s in seconds
        ]
        return [cold, *timed]

    cells = {
        ("small", 0, "shardstream"): runs("shardstream", [1.0, 2.0, 1.0]),
        ("small", 0, "shardstream (Rust batches)"): runs("shardstream", [1.0, 1.0]),
        # The fastest peer differs by repetition: 3 s, then 2 s (LitData),
        # then 1.5 s (webdataset).
        ("small", 0, "webdataset"): runs("webdataset", [4.0, 3.0, 1.5]),
        ("small", 0, "litdata"): runs("litdata", [3.0, 2.0, 4.0]),
        ("small", 2, "webdataset"): runs("webdataset", [1.0]),
    }
    ratios = bench.best_peer_ratios(cells)
    assert set(ratios) == {("small", 0, "shardstream"), ("small", 0, "shardstream (Rust batches)")}
    median, each = ratios[("small", 0, "shardstream")]
    assert each == [3.0, 1.0, 1.5] and median == 1.5
    assert ratios[("small", 0, "shardstream (Rust batches)")] == (2.5, [3.0, 2.0])
    table = bench.best_peer_table(ratios)
    assert "| small | 0 | shardstream | 1.50x | 3.00, 1.00, 1.50 |" in table


@pytest.mark.parametrize("num_workers", [0, 2])
def test_s3_mode_epoch_reads_the_published_objects_once(
    bench: ModuleType,
    profiles: dict[str, Path],
    s3: S3Server,
    s3_credentials: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    num_workers: int,
) -> None:
    """The S3 mode's shardstream reader, against a real S3 server (moto's),
    over the objects `publish` lays out."""
    data = profiles["small"]
    root = tmp_path / "s3root"
    bench.publish(root, data)
    client = s3.client()
    if bench.S3_BUCKET not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
        client.create_bucket(Bucket=bench.S3_BUCKET)
    for path in sorted(p for p in (root / bench.S3_BUCKET).rglob("*") if p.is_file()):
        key = str(path.relative_to(root / bench.S3_BUCKET))
        client.upload_file(str(path), bench.S3_BUCKET, key)
    monkeypatch.setenv(bench.S3_ENDPOINT_ENV, s3.endpoint_url)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    result = bench.run_epoch(data, "shardstream (Rust batches)", num_workers)
    assert result["storage"] == "s3"
    assert result["samples"] == result["expected_samples"]
    assert (result["duplicates"], result["missing"], result["unexpected"]) == (0, 0, 0)
    assert result["shardstream_bytes_read"] == result["disk_bytes"]


def test_publish_links_every_file_under_the_bucket(
    bench: ModuleType, profiles: dict[str, Path], tmp_path: Path
) -> None:
    data = profiles["audio"]
    root = tmp_path / "s3root"
    bench.publish(root, data)
    bench.publish(root, data)  # again: the same links anew
    published = sorted((root / bench.S3_BUCKET / data.name / "tar").iterdir())
    assert [p.name for p in published] == [p.name for p in bench.tar_paths(data)]
    for path, original in zip(published, bench.tar_paths(data), strict=True):
        assert path.stat().st_ino == original.stat().st_ino


def test_a_profile_generated_again_with_other_parameters_drops_what_was_made_from_the_old(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = bench.generate("audio", tmp_path, quick=True)
    (data / "litdata").mkdir()
    (data / "litdata" / "index.json").write_text("{}")
    root = tmp_path / "s3root"
    bench.publish(root, data)
    stale = root / bench.S3_BUCKET / data.name / "tar" / "stale.tar"
    stale.write_bytes(b"")

    shards, per_shard = bench.PROFILES["audio"]["quick"]
    monkeypatch.setitem(bench.PROFILES, "audio", {"quick": (shards, per_shard + 1)})
    again = bench.generate("audio", tmp_path, quick=True)
    assert again == data and not (data / "litdata").exists()
    assert len(bench.load_meta(data)["keys"]) == shards * (per_shard + 1)
    bench.publish(root, data)
    published = sorted((root / bench.S3_BUCKET / data.name / "tar").iterdir())
    assert [p.name for p in published] == [p.name for p in bench.tar_paths(data)]
    for path, original in zip(published, bench.tar_paths(data), strict=True):
        assert path.stat().st_ino == original.stat().st_ino


def test_server_log_reads_the_address_and_adds_up_get_lengths(bench: ModuleType) -> None:
    lines = [
        "listening on http://127.0.0.1:9",
        "get bench/small/tar/a.tar 0 1000",
        "get bench/small/tar/b.tar 512 24",
    ]
    script = "import sys; sys.stdout.write(sys.argv[1])"
    process = subprocess.Popen(
        [sys.executable, "-c", script, "\n".join(lines) + "\n"], stdout=subprocess.PIPE, text=True
    )
    try:
        log = bench.ServerLog(process)
        assert log.wait_address("the test server") == "http://127.0.0.1:9"
        assert log.counts(quiet=0.1) == (2, 1024)
    finally:
        process.wait(timeout=30)


def test_server_log_fails_when_no_address_comes(bench: ModuleType) -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"], stdout=subprocess.PIPE, text=True)
    try:
        with pytest.raises(RuntimeError, match="did not start"):
            bench.ServerLog(process).wait_address("the silent server")
    finally:
        process.wait(timeout=30)


def test_s3_report_shows_get_amplification_and_requests(bench: ModuleType) -> None:
    def run(get_bytes: int) -> dict[str, Any]:
        return {
            "library": "shardstream",
            "version": "1",
            "samples": 100,
            "expected_samples": 100,
            "payload_bytes": 10**6,
            "disk_bytes": 2 * 10**6,
            "seconds": 1.0,
            "cpu_seconds": 1.0,
            "rss_main_mb": 1.0,
            "rss_worker_mb": 1.0,
            "duplicates": 0,
            "missing": 0,
            "unexpected": 0,
            "rchar_bytes": 0,
            "device_read_bytes": 0,
            "cold_cache": False,
            "s3_gets": 8,
            "s3_get_bytes": get_bytes,
        }

    summary = bench.summarize([run(2 * 10**6), run(3 * 10**6), run(2 * 10**6)])
    assert summary["read_amplification"] == 1 and summary["s3_gets"] == 8
    table = bench.markdown({("small", 0, "shardstream"): summary}, "# title")
    assert "GET bytes / object bytes (GETs)" in table
    assert next(line for line in table.splitlines() if "| shardstream |" in line).endswith(
        "| 1.00 (8) |"
    )


def test_failed_runs_are_listed_with_their_last_error(bench: ModuleType) -> None:
    error = "mosaicml failed with 1:\nTraceback ...\n  File x\nUnicodeDecodeError: bad byte\n\n"
    assert bench.last_line(error) == "UnicodeDecodeError: bad byte"
    assert bench.failed_runs({}) == ""
    listed = bench.failed_runs({("small", 2, "mosaicml-streaming"): ["A: one", "B: two"]})
    assert "mosaicml-streaming, small, 2 workers: 2 run(s) failed; last error: `B: two`" in listed
    assert not bench.any_timed([{"cold_cache": True}])
    assert bench.any_timed([{"cold_cache": True}, {"cold_cache": False}])


PHASES = BENCH.parent / "epoch_phases.py"


def epoch_phases(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """benches/peers/epoch_phases.py over the audio profile at `data`."""
    command = [sys.executable, str(PHASES), "--profile", "audio", "--data-root", str(data.parent)]
    return subprocess.run(
        [*command, "--repeats", "1", *args], capture_output=True, text=True, timeout=300
    )


def test_epoch_phases_compares_options_over_every_sample(
    bench: ModuleType, profiles: dict[str, Path]
) -> None:
    data = profiles["audio"]
    run = epoch_phases(data, "--workers", "2", "--compare", "raise_malloc_thresholds=false")
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows] == [
        "| options",
        "| defaults",
        "| raise_malloc_thresholds=False",
    ]
    samples = len(bench.load_meta(data)["keys"])
    assert all(row.rstrip(" |").endswith(f"{samples:,}") for row in rows[1:]), rows


def test_epoch_phases_refuses_an_unknown_option(profiles: dict[str, Path]) -> None:
    run = epoch_phases(profiles["audio"], "--workers", "0", "--compare", "no_such_option=1")
    assert run.returncode != 0
    assert "no option 'no_such_option'" in run.stderr

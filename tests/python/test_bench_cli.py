"""``shardstream bench`` and ``shardstream.bench.run_bench``: each verdict
on a setup built to be bound by that stage (a slow server, a heavy
transform, a slow consumer), by ten times or more, so that a loaded
machine does not change the answer; the command line's output and errors."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from fault_proxy import Faults as ProxyFaults
from fault_proxy import running_fault_proxy

from shardstream.bench import STAGES, run_bench, verdict


def heavy_transform(sample):
    """About 20 ms of CPU per sample."""
    deadline = time.thread_time() + 0.02
    while time.thread_time() < deadline:
        pass
    return sample


def assert_bound_by(result, stage):
    # The shares of the run's time add up, "other" (no stage) included.
    assert abs(sum(result.stages.values()) - 1) < 1e-9, result.stages
    others = [share for name, share in result.stages.items() if name not in (stage, "other")]
    assert result.bound == stage, result.summary()
    assert result.stages[stage] > 0.5, result.summary()
    # The setups make the bound stage dominate; the verdict does not hang on a hair.
    assert result.stages[stage] > 3 * max(others), result.summary()


def test_a_slow_server_is_storage_bound(http, dataset):
    faults = ProxyFaults(first_byte_delay=0.3, bandwidth=40_000)
    with running_fault_proxy(http.base_url, faults) as proxy:
        spec = proxy.endpoint_url + "/" + http.shard_spec(len(dataset.paths)).split("/", 3)[3]
        result = run_bench(spec, samples=24, batch_size=4, count_samples=False)
    assert result.samples >= 24
    assert_bound_by(result, "storage")
    assert result.advice.startswith("storage-bound: ")
    # num_workers 0: the budget of a process that reads alone.
    assert "raise read_ahead_bytes (now 67,108,864) / more workers" in result.advice
    assert result.stats["storage_wait_ns"] > 0.5 * result.seconds * 1e9
    assert result.mb_per_s > 0


def test_a_heavy_transform_is_decode_bound(dataset):
    result = run_bench(dataset.spec, samples=30, batch_size=2, transform=heavy_transform)
    assert_bound_by(result, "decode")
    assert result.advice.startswith("decode-bound: ")
    assert "decode threads busy" in result.advice and "cores idle" in result.advice
    assert result.stats["transform_ns"] >= 30 * 20_000_000
    # The CPU the transform burnt is counted, per sample.
    assert result.cpu_us_per_sample >= 15_000


def test_a_slow_consumer_is_consumer_bound(dataset):
    batches = []
    result = run_bench(
        dataset.spec, samples=32, batch_size=4, consumer=batches.append, consumer_delay_ms=60
    )
    assert len(batches) == 8 and all(len(b) == 4 for b in batches)
    assert_bound_by(result, "consumer")
    assert result.advice.startswith("consumer-bound: the loader waits on your code")


def test_the_figures_agree_with_a_plain_loop_over_the_same_loader(tmp_path):
    """What ``run_bench`` reports is what a plain loop over the same
    DataLoader measures: its CPU per sample within 10% of the loop's, so the
    bench adds no work of its own (no more than a tenth of the sample's
    cost), and its samples/s are its samples over the wall time it took,
    within the call's own.

    Each sample costs a known 300 us of CPU (a spin on the thread's CPU
    clock), so the figures do not hang on the few microseconds of a bare
    sample, which a loaded machine (the suite runs in parallel) inflates by
    more than 10%; the bench is held to that cost from below too."""
    import resource
    import tarfile
    from io import BytesIO

    from torch.utils.data import DataLoader

    from shardstream import StreamingDataset

    spin_us = 300

    def spin(sample):
        deadline = time.thread_time() + spin_us / 1e6
        while time.thread_time() < deadline:
            pass
        return sample

    for shard in range(4):
        with tarfile.open(tmp_path / f"s-{shard}.tar", "w") as tar:
            for i in range(500):
                info = tarfile.TarInfo(f"{shard}-{i:06d}.bin")
                info.size = 100
                tar.addfile(info, BytesIO(bytes(100)))
    spec = str(tmp_path / "s-{0..3}.tar")

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    def plain() -> float:
        dataset = StreamingDataset(spec, transform=spin)
        loader = DataLoader(dataset, batch_size=32, collate_fn=list)
        before, count = cpu(), 0
        for batch in loader:
            count += len(batch)
        assert count == 2_000
        return (cpu() - before) / count * 1e6

    def bench() -> float:
        called = time.perf_counter()
        result = run_bench(spec, epochs=1, batch_size=32, transform=spin)
        took = time.perf_counter() - called
        assert result.samples == 2_000
        assert result.seconds <= took
        assert result.samples_per_s == pytest.approx(result.samples / result.seconds)
        return result.cpu_us_per_sample

    loops, benches = [], []
    for turn in range(4):
        order = (plain, bench) if turn % 2 else (bench, plain)
        for measure in order:
            (loops if measure is plain else benches).append(measure())
    assert min(benches) >= spin_us, benches
    assert 0.9 <= min(benches) / min(loops) <= 1.1, (benches, loops)


def test_workers_count_in_the_parents_stats_and_cpu(dataset):
    result = run_bench(dataset.spec, workers=2, epochs=1, transform=heavy_transform)
    assert result.samples == len(dataset.samples) == result.stats["samples"]
    # The workers' CPU (about 20 ms per sample) is in the run's.
    assert result.cpu_us_per_sample >= 15_000
    assert_bound_by(result, "decode")


def test_bad_limits_are_refused_naming_the_option(dataset):
    with pytest.raises(ValueError, match="invalid option seconds"):
        run_bench(dataset.spec, seconds=0)
    with pytest.raises(ValueError, match="invalid option workers"):
        run_bench(dataset.spec, workers=-1)
    with pytest.raises(ValueError, match="invalid option consumer_delay_ms"):
        run_bench(dataset.spec, consumer_delay_ms=-5)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardstream", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_command_prints_one_json_object(dataset):
    done = cli(
        "bench", dataset.spec, "--json", "--batch-size", "4", "--samples", "24",
        "--consumer-delay-ms", "80", "--decode", "json=json", "--option", "shuffle_buffer=0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["bound"] == "consumer", result["advice"]
    assert set(result["stages"]) == {*STAGES, "other"}
    assert abs(sum(result["stages"].values()) - 1) < 1e-9, result["stages"]
    assert result["samples"] >= 24
    assert result["options"] == {
        "workers": 0,
        "batch_size": 4,
        "rust_batches": False,
        "decode": {"json": "json"},
    }
    assert result["stats"]["decoded_bytes"] > 0
    for key in ("samples_per_s", "mb_per_s", "cpu_us_per_sample", "advice"):
        assert key in result
    # Progress goes to stderr, never into the JSON.
    assert "samples/s" in done.stderr


def test_the_command_prints_a_summary(dataset):
    done = cli("bench", dataset.spec, "--epochs", "1", "--quiet")
    assert done.returncode == 0, done.stderr
    assert f"{len(dataset.samples)} samples in " in done.stdout
    assert "us per sample" in done.stdout and "where the time went: storage" in done.stdout
    assert "-bound: " in done.stdout
    assert done.stderr == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--decode", "jpg"], "invalid option --decode: 'jpg'"),
        (["--option", "shuffle_buffer"], "invalid option --option: 'shuffle_buffer'"),
        (["--option", "shuffle_buffer=-1"], "shuffle_buffer"),
        (["--seconds", "-1"], "invalid option seconds"),
    ],
)
def test_the_command_refuses_bad_options(dataset, args, message):
    done = cli("bench", dataset.spec, "--quiet", *args)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_the_help_names_bench_beside_the_cores_commands():
    done = cli("--help")
    assert done.returncode == 0, done.stderr
    # One line per command, bench among them.
    commands = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")}
    assert {"inspect", "index", "plan", "verify", "explain", "write", "bench"} <= commands
    assert "Measure the loader" in done.stdout
    done = cli("bench", "--help")
    assert done.returncode == 0 and "--consumer-delay-ms" in done.stdout


def test_other_commands_still_go_to_the_core(dataset):
    done = cli("inspect", str(dataset.paths[0]), "--limit", "1")
    assert done.returncode == 0, done.stderr
    assert dataset.samples[0].key in done.stdout


def test_option_batch_size_benches_batches_collated_in_rust(dataset):
    """``--option batch_size=N`` (what the handoff advice names) has the
    dataset collate batches of N in Rust, handed over by a DataLoader with
    ``batch_size=None``: distinct from the DataLoader's ``--batch-size``."""
    done = cli(
        "bench", dataset.spec, "--json", "--quiet", "--option", "batch_size=4",
        "--decode", "json=json", "--samples", "24",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["samples"] == 24
    assert result["options"] == {
        "workers": 0,
        "batch_size": 4,
        "rust_batches": True,
        "decode": {"json": "json"},
    }
    done = cli("bench", dataset.spec, "--quiet", "--batch-size", "8", "--option", "batch_size=4")
    assert done.returncode == 2
    assert "--batch-size" in done.stderr and "--option batch_size" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_rust_batches_through_workers_count_every_sample(dataset):
    batches = []
    result = run_bench(
        dataset.spec, workers=2, batch_size=4, rust_batches=True, epochs=1, consumer=batches.append
    )
    assert result.samples == len(dataset.samples) == result.stats["samples"]
    assert all(len(batch["__key__"]) <= 4 for batch in batches)


def test_the_handoff_advice_names_the_rust_batches_flag():
    stats = {"handoff_ns": 9 * 10**9, "parse_ns": 10**8}
    _, bound, advice, _, _ = verdict(
        stats, seconds=10.0, consumer_seconds=0.1, lanes=1, cpu_seconds=10.0, cores=2
    )
    assert bound == "handoff"
    assert "shardstream bench --option batch_size=N" in advice, advice
    _, _, again, _, _ = verdict(
        stats,
        seconds=10.0,
        consumer_seconds=0.1,
        lanes=1,
        cpu_seconds=10.0,
        cores=2,
        rust_batches=True,
    )
    assert "batch_size" not in again and "num_workers" in again, again


@pytest.mark.parametrize(
    "value",
    ['[["Authorization", "Bearer s3cr3t"]]', "Authorization: Bearer s3cr3t"],
    ids=["pairs", "header-line"],
)
def test_the_command_never_shows_a_header_value(dataset, value):
    done = cli("bench", dataset.spec, "--quiet", "--option", f"http_headers={value}")
    assert done.returncode == 2
    assert "invalid option http_headers" in done.stderr and "a dict" in done.stderr, done.stderr
    assert "s3cr3t" not in done.stderr + done.stdout

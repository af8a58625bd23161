"""Fork safety and the GIL: no native thread before the first ``next()``,
and a blocked ``next()`` lets other Python threads run."""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import shardstream
from shardstream import ShardStreamError, StreamingDataset


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settled_threads(timeout: float = 10.0) -> int:
    """The thread count once it has not changed for 0.3 s (threads of earlier
    tests may still be ending)."""
    deadline = time.monotonic() + timeout
    count, since = native_threads(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = native_threads()
        if now != count:
            count, since = now, time.monotonic()
        elif time.monotonic() - since >= 0.3:
            break
    return count


def test_no_thread_before_iter_and_threads_end_after(dataset) -> None:
    before = settled_threads()
    ds = StreamingDataset(dataset.spec, shuffle_buffer=4)
    ds.set_epoch(3)
    assert ds.stats()["samples"] == 0
    assert native_threads() == before, "constructing the dataset started threads"
    stream = iter(ds)
    assert ds.state_dict()["produced"] == 0
    assert native_threads() == before, "threads started before the first next()"
    first = next(stream)
    assert native_threads() > before, "the stream should run on its own threads"
    assert first["__key__"] in dataset.keys
    assert 1 + sum(1 for _ in stream) == len(dataset.keys)
    del stream
    deadline = time.monotonic() + 10
    while native_threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert native_threads() == before, "stream threads outlived the stream"


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_waiting_for_a_sample_releases_the_gil(tmp_path: Path) -> None:
    fifo = tmp_path / "slow.tar"
    os.mkfifo(fifo)
    payload = tar_bytes([("k.txt", b"hello"), ("k.cls", b"3")])
    ticks = 0

    def writer() -> None:
        # Runs Python code while the main thread waits inside next(): only
        # possible if that wait released the GIL.
        nonlocal ticks
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            ticks += 1
        with open(fifo, "wb") as f:
            f.write(payload)

    ds = StreamingDataset(str(fifo), shuffle_buffer=0, io_timeout=20.0)
    stream = iter(ds)
    thread = threading.Thread(target=writer)
    thread.start()
    started = time.monotonic()
    sample = next(stream)
    waited = time.monotonic() - started
    thread.join(timeout=20)
    assert sample["__key__"] == "k" and sample["txt"] == b"hello" and sample["cls"] == b"3"
    assert waited >= 0.4, f"next() returned after {waited:.2f}s, before the writer was done"
    assert ticks > 1000, f"the writer thread ran only {ticks} loop iterations"
    with pytest.raises(StopIteration):
        next(stream)


def test_a_stalled_shard_times_out_with_a_read_error(tmp_path: Path) -> None:
    fifo = tmp_path / "stalled.tar"
    os.mkfifo(fifo)
    ds = StreamingDataset(str(fifo), io_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(shardstream.ShardReadError, match=r"stalled\.tar.*byte offset 0"):
        next(iter(ds))
    assert time.monotonic() - started < 10
    # Unblock the reader still waiting in open(), without waiting ourselves.
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    except OSError:
        pass


def signal_masks(pid: int) -> str:
    """The signals process ``pid`` blocks and ignores (/proc), to say why a
    SIGINT did not reach it (SIGINT is bit 1)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return ", ".join(line for line in status if line.startswith(("SigBlk", "SigIgn")))


@pytest.fixture
def ctrl_c_handled() -> Any:
    """SIGINT raises KeyboardInterrupt in this process (and is not ignored
    by the processes it starts) for the test: a shell without job control
    starts its background commands, pytest included, with SIGINT ignored,
    and Python then leaves it ignored."""
    import signal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.usefixtures("ctrl_c_handled")
def test_ctrl_c_interrupts_resolving_a_dataset():
    """Listing a prefix on a server that accepts and never answers: Ctrl-C
    (SIGINT) ends the constructor at once with KeyboardInterrupt, long
    before the S3 timeouts."""
    import signal
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    started = time.monotonic()
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            try:
                StreamingDataset(
                    "s3://bucket/prefix/",
                    s3={
                        "endpoint_url": f"http://127.0.0.1:{port}",
                        "path_style": True,
                        "unsigned": True,
                        "first_byte_timeout": 60.0,
                        "max_attempts": 1,
                    },
                )
            except ShardStreamError as error:
                pytest.fail(f"not interrupted ({signal_masks(os.getpid())}): {error}")
    finally:
        timer.cancel()
        server.close()
    assert time.monotonic() - started < 10


@pytest.mark.usefixtures("ctrl_c_handled")
def test_ctrl_c_stops_the_command_line_at_once():
    """`shardstream inspect` of a shard on a server that accepts and never
    answers: Ctrl-C (SIGINT) ends the command within seconds with status
    130 and one line, long before the first-byte timeout."""
    import signal
    import socket
    import subprocess
    import sys

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    command = [sys.executable, "-m", "shardstream", "inspect"]
    process = subprocess.Popen(
        [*command, f"http://127.0.0.1:{port}/shard.tar"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The command has connected: it waits on the server's answer.
        server.settimeout(120)
        connection, _ = server.accept()
        assert process.poll() is None
        interrupted = time.monotonic()
        masks = signal_masks(process.pid)
        process.send_signal(signal.SIGINT)
        try:
            _, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"not interrupted within 30 s (before SIGINT: {masks})")
        assert time.monotonic() - interrupted < 5, stderr
        connection.close()
    finally:
        server.close()
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr, stderr


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_shard_whose_open_never_returns_leaks_nothing_per_attempt(tmp_path: Path) -> None:
    # A pipe with no writer: open() blocks until one comes, as on a hung mount.
    fifo = tmp_path / "blocked.tar"
    os.mkfifo(fifo)
    counts = []
    try:
        for _ in range(5):
            ds = StreamingDataset(str(fifo), io_timeout=0.3)
            started = time.monotonic()
            with pytest.raises(shardstream.ShardReadError) as raised:
                next(iter(ds))
            assert time.monotonic() - started < 5, "the failure took too long"
            message = str(raised.value)
            assert "blocked.tar" in message, message
            assert "no data for" in message or "open timed out" in message, message
            del ds, raised
            counts.append((settled_threads(), open_descriptors()))
        # The first attempt may leave one thread blocked in open(); the
        # attempts after it leave nothing more behind.
        threads, descriptors = zip(*counts, strict=True)
        assert max(threads) - min(threads) == 0, counts
        assert max(descriptors) - min(descriptors) <= 1, counts
    finally:
        # Let the blocked open() return, so that nothing waits at exit.
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

"""Helpers shared by the shardstream Python tests.

Expected values are always computed here from the tar files themselves, with
Python's ``tarfile`` and an independent implementation of the WebDataset
grouping rule, never hard-coded.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tarfile
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES_DIR = REPO_ROOT / "examples"


def load_example(name: str) -> ModuleType:
    """Imports ``examples/<name>.py`` by path (the examples are not a package)."""
    path = EXAMPLES_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"shardstream_example_{name}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------
# The WebDataset grouping rule, re-implemented independently of the Rust core.
# --------------------------------------------------------------------------


def split_member(name: str) -> tuple[str, str] | None:
    """``dir/stem.ext.more`` -> ``("dir/stem", "ext.more")`` (field lower-cased);
    ``None`` when the basename has no dot, starts with one or ends at its first dot."""
    base_start = name.rfind("/") + 1
    base = name[base_start:]
    dot = base.find(".")
    if dot <= 0 or dot == len(base) - 1:
        return None
    return name[: base_start + dot], base[dot + 1 :].lower()


@dataclass
class ExpectedSample:
    """One sample as read with ``tarfile``."""

    url: str
    key: str
    fields: dict[str, bytes] = field(default_factory=dict)

    def digest(self) -> dict[str, str]:
        return {name: sha256(value) for name, value in self.fields.items()}


def sample_members(tar: tarfile.TarFile) -> Iterator[tuple[tarfile.TarInfo, tuple[str, str]]]:
    """The regular members that carry a field, with their ``(key, field)``."""
    for member in tar:
        split = split_member(member.name) if member.isreg() else None
        if split is not None:
            yield member, split


def read_tar_samples(path: str | Path, url: str | None = None) -> list[ExpectedSample]:
    """The samples of one tar shard, in order, by the WebDataset rule."""
    url = str(path) if url is None else url
    samples: list[ExpectedSample] = []
    with tarfile.open(path, "r:") as tar:
        for member, (key, name) in sample_members(tar):
            extracted = tar.extractfile(member)
            assert extracted is not None
            data = extracted.read()
            if samples and samples[-1].key == key:
                if name in samples[-1].fields:
                    raise ValueError(f"field {name} repeated in {key}")
                samples[-1].fields[name] = data
            else:
                samples.append(ExpectedSample(url, key, {name: data}))
    return samples


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sample_digest(sample: dict[str, Any]) -> dict[str, str]:
    """``{field: sha256}`` of a sample dict yielded by shardstream."""
    out = {}
    for name, value in sample.items():
        if name.startswith("__"):
            continue
        assert isinstance(value, bytes), (name, type(value))
        out[name] = sha256(value)
    return out


@dataclass
class DatasetInfo:
    """A dataset on disk plus what it contains, read independently."""

    root: Path
    paths: list[Path]
    spec: str
    samples: list[ExpectedSample]

    @property
    def urls(self) -> list[str]:
        return [str(p) for p in self.paths]

    @property
    def keys(self) -> list[str]:
        """Every key, in file order (shard by shard)."""
        return [s.key for s in self.samples]

    @property
    def sizes(self) -> list[int]:
        return [p.stat().st_size for p in self.paths]

    def keys_of(self, urls: Iterable[str]) -> list[str]:
        wanted = set(urls)
        return [s.key for s in self.samples if s.url in wanted]

    def by_key(self) -> dict[str, ExpectedSample]:
        out = {s.key: s for s in self.samples}
        assert len(out) == len(self.samples), "dataset keys must be unique"
        return out


def describe(paths: Sequence[Path], spec: str) -> DatasetInfo:
    samples = [s for p in paths for s in read_tar_samples(p)]
    return DatasetInfo(Path(paths[0]).parent, list(paths), spec, samples)


def brace_spec(root: Path, prefix: str, first: int, last: int) -> str:
    return f"{root}/{prefix}-{{{first:06d}..{last:06d}}}.tar"


# --------------------------------------------------------------------------
# Writing custom tars.
# --------------------------------------------------------------------------

Member = tuple[str, bytes] | tarfile.TarInfo


def regular(name: str, size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = 0
    return info


def special(name: str, kind: bytes, linkname: str = "") -> tarfile.TarInfo:
    """A non-regular entry (``tarfile.DIRTYPE``, ``SYMTYPE``, ``LNKTYPE``, ...)."""
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    info.mtime = 0
    return info


def tar_bytes(
    members: Iterable[Member],
    *,
    format: int = tarfile.GNU_FORMAT,
    pax_headers: dict[str, str] | None = None,
    encoding: str = "utf-8",
) -> bytes:
    """A tar archive of ``members``: ``(name, data)`` pairs are regular files,
    ``TarInfo`` objects are added as they are (for directories, links, ...)."""
    buffer = io.BytesIO()
    with tarfile.open(
        fileobj=buffer,
        mode="w",
        format=format,
        pax_headers=pax_headers or {},
        encoding=encoding,
    ) as tar:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tar.addfile(member)
            else:
                name, data = member
                tar.addfile(regular(name, len(data)), io.BytesIO(data))
    return buffer.getvalue()


def write_tar(path: Path, members: Iterable[Member], **kwargs: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(tar_bytes(members, **kwargs))
    return path


def retype(data: bytes, name: str, typeflag: bytes) -> bytes:
    """``data`` with the header of member ``name`` given another type flag
    (and a fixed checksum): e.g. a directory entry whose name has no
    trailing slash, which ``tarfile`` itself would never write."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        offset = tar.getmember(name).offset
    header = bytearray(data[offset : offset + 512])
    header[156:157] = typeflag
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return data[:offset] + bytes(header) + data[offset + 512 :]


def member_offsets(data: bytes) -> dict[str, tuple[int, int]]:
    """``{name: (data_offset, size)}`` of the regular members of a tar in memory."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        return {m.name: (m.offset_data, m.size) for m in tar if m.isreg()}


# --------------------------------------------------------------------------
# Iterating.
# --------------------------------------------------------------------------


def loader(dataset: Any, num_workers: int, **kwargs: Any) -> Any:
    """A real ``torch.utils.data.DataLoader`` yielding single samples."""
    from torch.utils.data import DataLoader

    if num_workers > 0:
        kwargs.setdefault("timeout", 120)
    return DataLoader(dataset, batch_size=None, num_workers=num_workers, **kwargs)


def collect(iterable: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One pass over ``iterable`` (a dataset or DataLoader).

    On error, the iterator is dropped before the exception propagates (with
    its traceback cut), so a DataLoader's worker processes are shut down at
    once instead of lingering, referenced by the traceback, until exit.
    """
    iterator = iter(iterable)
    error: BaseException | None = None
    try:
        samples = list(iterator)
    except Exception as exc:
        error = exc.with_traceback(None)
    del iterator
    if error is not None:
        raise error
    return samples


def keys_of(samples: Iterable[dict[str, Any]]) -> list[str]:
    return [s["__key__"] for s in samples]


def assert_exactly_once(got: Sequence[str], expected: Iterable[str]) -> None:
    """``got`` holds every expected key exactly once and nothing else."""
    counts = Counter(got)
    duplicates = sorted(k for k, n in counts.items() if n > 1)
    assert not duplicates, f"keys yielded more than once: {duplicates[:10]}"
    expected_set = set(expected)
    missing = sorted(expected_set - counts.keys())
    extra = sorted(counts.keys() - expected_set)
    assert not missing and not extra, f"missing {missing[:10]}, unexpected {extra[:10]}"


# --------------------------------------------------------------------------
# Manifests, uneven datasets and saved states (manifest, resume and
# distributed tests).
# --------------------------------------------------------------------------

SCHEMAS_DIR = REPO_ROOT / "schemas"
UNEVEN_COUNTS = (1, 40, 3, 17, 0, 25)
"""Samples per shard of the uneven dataset: one tiny shard, one empty."""


def uneven_members(shard: int, count: int, seed: int = 0) -> list[tuple[str, bytes]]:
    """``count`` two-member samples (``.txt`` of 1..1500 random bytes, ``.cls``)
    with keys ``u{shard:02d}-{index:04d}``, unique across shards."""
    rng = random.Random(seed * 1_000_003 + shard)
    members: list[tuple[str, bytes]] = []
    for index in range(count):
        key = f"u{shard:02d}-{index:04d}"
        members.append((f"{key}.txt", rng.randbytes(rng.randrange(1, 1500))))
        members.append((f"{key}.cls", str(index % 10).encode()))
    return members


def write_uneven_dataset(
    root: Path, counts: Sequence[int] = UNEVEN_COUNTS, *, prefix: str = "part", seed: int = 0
) -> DatasetInfo:
    """Shards ``{prefix}-{i:06d}.tar`` under ``root`` holding ``counts[i]``
    samples each (so samples, not bytes, are what is uneven)."""
    paths = [
        write_tar(root / f"{prefix}-{shard:06d}.tar", uneven_members(shard, count, seed))
        for shard, count in enumerate(counts)
    ]
    info = describe(paths, brace_spec(root, prefix, 0, len(paths) - 1))
    assert [len(shard_keys(info, p)) for p in paths] == list(counts)
    return info


def shard_keys(info: DatasetInfo, path: str | Path) -> list[str]:
    """The keys of one shard of ``info``, in file order."""
    return info.keys_of([str(path)])


def shardstream_cli(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Runs ``python -m shardstream ARGS`` (with a timeout)."""
    return subprocess.run(
        [sys.executable, "-m", "shardstream", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def index_manifest(specs: Iterable[str | Path], output: Path) -> dict[str, Any]:
    """Runs ``shardstream index SPECS -o OUTPUT`` and returns the manifest."""
    proc = shardstream_cli("index", *specs, "-o", output)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    manifest: dict[str, Any] = json.loads(output.read_text())
    return manifest


def tar_sample_spans(path: str | Path) -> list[tuple[str, int, int]]:
    """``(key, offset, length)`` of every sample of a tar, read with ``tarfile``:
    the offset is where the header of the sample's first member starts (its
    first GNU long-name or PAX extension header, if any), the length runs to
    the end of the last member's data padded to a 512-byte block."""
    spans: list[list[Any]] = []
    with tarfile.open(path, "r:") as tar:
        for member, split in sample_members(tar):
            end = member.offset_data + -(-member.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            if spans and spans[-1][0] == split[0]:
                spans[-1][2] = end
            else:
                spans.append([split[0], member.offset, end])
    return [(key, start, end - start) for key, start, end in spans]


def load_schema(name: str) -> dict[str, Any]:
    """``schemas/<name>.schema.json``."""
    schema: dict[str, Any] = json.loads((SCHEMAS_DIR / f"{name}.schema.json").read_text())
    return schema


def slot_states(obj: Any) -> list[dict[str, Any]]:
    """Every shardstream slot state nested anywhere in ``obj`` (e.g. in a
    ``StatefulDataLoader.state_dict()``), in traversal order."""
    found: list[dict[str, Any]] = []
    if isinstance(obj, dict):
        if obj.get("format") == "shardstream.state":
            return [obj]
        for value in obj.values():
            found += slot_states(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            found += slot_states(value)
    return found


def epoch_sequence(
    info: DatasetInfo, *, seed: int, epoch: int, shuffle_shards: bool = True
) -> list[str]:
    """The epoch's global sample sequence: shards in the epoch's order (as the
    planner orders them), each shard's keys in file order (from ``tarfile``)."""
    from shardstream import _core

    (order,) = _core.plan_epoch(
        [1] * len(info.paths),
        seed=seed,
        epoch=epoch,
        world_size=1,
        num_workers=1,
        shuffle_shards=shuffle_shards,
    )
    return [key for shard in order for key in shard_keys(info, info.paths[shard])]


def key_batch(samples: list[dict[str, Any]]) -> list[str]:
    """A DataLoader ``collate_fn`` that keeps only the keys of a batch."""
    return [s["__key__"] for s in samples]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from ``/proc``), parents first."""
    found = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def kill_launch(proc: subprocess.Popen) -> None:
    """Kills a torchrun agent, its ranks and their DataLoader workers. The
    agent starts each rank in a session of its own, so killing the agent's
    process group alone would leave the ranks running."""
    if proc.poll() is not None:
        return
    groups = {proc.pid}
    for pid in descendants(proc.pid):
        with contextlib.suppress(OSError):
            groups.add(os.getpgid(pid))
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    proc.wait()


def stacks(pid: int) -> str:
    """The Python and native stacks of ``pid`` and its descendants, as
    py-spy (a dev requirement) dumps them: what a test that timed out
    shows of where each process waited."""
    spy = Path(sys.executable).with_name("py-spy")
    shown = []
    for each in [pid, *descendants(pid)]:
        try:
            dump = subprocess.run(
                [str(spy), "dump", "--native", "--pid", str(each)],
                capture_output=True,
                text=True,
                timeout=30,
            )
            shown.append(f"--- {each}\n{dump.stdout[-4000:]}{dump.stderr[-1000:]}")
        except (OSError, subprocess.TimeoutExpired) as error:
            shown.append(f"--- {each}: no stack ({error})")
    return "\n".join(shown)


def assert_verified(ledger_dir: Path, epochs: int) -> None:
    """``shardstream verify`` (a new process) proves ``epochs`` epochs of the
    ledger in ``ledger_dir`` complete, each sample exactly once."""
    done = subprocess.run(
        [sys.executable, "-m", "shardstream", "verify", str(ledger_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and len(report["epochs"]) == epochs, report
    for epoch in report["epochs"]:
        assert epoch["complete"] and epoch["distinct"] == epoch["expected"] > 0, epoch


def run_bounded(
    command: list[str], *, cwd: Any, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Runs ``command`` in a session of its own; on ``timeout`` kills it with
    every descendant (``kill_launch``) and fails the test. When it was killed
    by a signal, what is left of its process group (DataLoader workers) is
    ended too."""
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        where = stacks(proc.pid)
        kill_launch(proc)
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"{command} did not finish within {timeout} s\n"
            f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}\n"
            f"where each process was:\n{where}"
        )
    if proc.returncode < 0:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


# --------------------------------------------------------------------------
# New processes without torch's import each time
# --------------------------------------------------------------------------

# A server that imports torch and shardstream once, then forks one process
# per request (from one thread: nothing else runs in it), so that a test
# reading "in a new process" (a cache seen anew, no state in memory) pays a
# fork, not the 2 CPU seconds of a new interpreter importing torch.
_FORK_SERVER = r"""
import importlib, os, pickle, struct, sys, tempfile, traceback
sys.path[:0] = sys.argv[1:]
import torch, shardstream.dataset
requests, answers = sys.stdin.buffer, sys.stdout.buffer

def read_exactly(size):
    data = b""
    while len(data) < size:
        chunk = requests.read(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data

while (head := read_exactly(8)) is not None:
    module, name, args, env, cwd = pickle.loads(read_exactly(struct.unpack("<Q", head)[0]))
    output = tempfile.TemporaryFile()
    readable, writable = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(readable)
        os.dup2(output.fileno(), 1)
        os.dup2(output.fileno(), 2)
        try:
            os.environ.clear()
            os.environ.update(env)
            os.chdir(cwd)
            answer = (True, getattr(importlib.import_module(module), name)(*args))
        except BaseException:
            output.seek(0)
            printed = output.read()[-4000:].decode(errors="replace")
            answer = (False, traceback.format_exc() + "\noutput:\n" + printed)
        with os.fdopen(writable, "wb") as pipe:
            pipe.write(pickle.dumps(answer))
        os._exit(0)
    os.close(writable)
    with os.fdopen(readable, "rb") as pipe:
        body = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not body:
        output.seek(0)
        printed = output.read()[-4000:].decode(errors="replace")
        body = pickle.dumps((False, f"ended with wait status {status}, output:\n{printed}"))
    output.close()
    answers.write(struct.pack("<Q", len(body)) + body)
    answers.flush()
"""

_fork_server: list[subprocess.Popen[bytes]] = []


def _stop_fork_server() -> None:
    for server in _fork_server:
        kill_launch(server)
    _fork_server.clear()


def _running_fork_server() -> subprocess.Popen[bytes]:
    if not _fork_server:
        import atexit

        server = subprocess.Popen(
            [sys.executable, "-c", _FORK_SERVER, *sys.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        _fork_server.append(server)
        atexit.register(_stop_fork_server)
    return _fork_server[0]


def in_new_process(function: Any, *args: Any, timeout: float = 120) -> Any:
    """``function(*args)`` run in a new process, forked from a server that
    imported torch and shardstream (one per test process, started at the
    first call); its return value. ``function`` is a module-level function
    of a module the server can import (this one); the process sees this
    process's environment and working directory. An exception there, or no
    answer within ``timeout`` seconds, fails the test with what it printed."""
    import pickle
    import select
    import struct

    server = _running_fork_server()
    assert server.stdin is not None and server.stdout is not None
    request = (function.__module__, function.__qualname__, args, dict(os.environ), os.getcwd())
    body = pickle.dumps(request)
    server.stdin.write(struct.pack("<Q", len(body)) + body)
    server.stdin.flush()
    ready, _, _ = select.select([server.stdout], [], [], timeout)
    if not ready:
        _stop_fork_server()
        pytest.fail(f"{function.__name__}{args!r} did not finish within {timeout} s")
    (size,) = struct.unpack("<Q", server.stdout.read(8))
    ok, value = pickle.loads(server.stdout.read(size))
    if not ok:
        pytest.fail(f"{function.__name__} failed in its process:\n{value}")
    return value


def read_digests(urls: list[str], options: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Every sample's digest, read in order (run by ``in_new_process``)."""
    from shardstream import StreamingDataset

    ds = StreamingDataset(urls, shuffle_buffer=0, shuffle_shards=False, **options)
    return {s["__key__"]: sample_digest(s) for s in ds}


def read_texts(spec: str, cache: str, endpoint: str) -> dict[str, str]:
    """Each sample's ``txt``, read with ``cache_dir`` (from the S3 server
    at ``endpoint`` when given; run by ``in_new_process``)."""
    from shardstream import S3Config, StreamingDataset

    options: dict[str, Any] = {"cache_dir": cache, "shuffle_buffer": 0}
    if endpoint:
        options["s3"] = S3Config(endpoint_url=endpoint, region="us-east-1", path_style=True)
    return {s["__key__"]: s["txt"].decode() for s in StreamingDataset(spec, **options)}


def keys_and_ones(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A collator for the HF Trainer tests that knows nothing of sample ids
    (the Trainer adds them): the keys, and a column of ones. Here, not in
    the test module, so that the spawned workers that unpickle it import
    this light module only."""
    import torch

    assert all("__id__" not in s for s in samples)
    return {"keys": [s["__key__"] for s in samples], "ones": torch.ones(len(samples), 1)}

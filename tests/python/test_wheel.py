"""``make wheel`` packs the release build into a manylinux_2_28 wheel that
installs with pip into a fresh virtualenv and runs README's quickstart and
the packaged DDP check (``torchrun -m shardstream.ddp_check``) there; and
``make sdist`` makes a source distribution that pip builds and reads with.

The fresh virtualenv gets the wheel and its declared dependencies (numpy,
from the package index) by pip; torch, an optional extra of several GB with
its CUDA libraries, is lent by this test's own environment through a ``.pth``
file, after the install and after the ``shardstream`` command has run
without it.
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time
import venv
import zipfile
from pathlib import Path

import pytest
from _shardtest import REPO_ROOT

README = REPO_ROOT / "README.md"
TIMEOUT = 600


def quickstart() -> tuple[str, str]:
    """README's quickstart: its ``sh`` block (the index command) and its
    ``python`` block, as written."""
    text = README.read_text()
    section = text[text.index("## Quickstart") :]
    command = re.findall(r"```sh\n(.*?)```", section, re.S)[0]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    return command.strip(), code


def write_train_shards(root: Path, pattern: str) -> int:
    """The shards the quickstart names (``data/train/shard-{000000..000127}.tar``):
    two samples each of a 16x16 JPEG and a class label. Returns the count."""
    from PIL import Image

    first, last = map(int, re.search(r"\{(\d+)\.\.(\d+)\}", pattern).groups())  # type: ignore[union-attr]
    samples = 0
    for shard in range(first, last + 1):
        path = root / re.sub(r"\{.*\}", f"{shard:06d}", pattern)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(path, "w") as tar:
            for index in range(2):
                image = io.BytesIO()
                Image.new("RGB", (16, 16), (shard, index * 100, 7)).save(image, format="JPEG")
                key = f"{shard:06d}-{index}"
                for field, data in (("jpg", image.getvalue()), ("cls", str(index).encode())):
                    info = tarfile.TarInfo(f"{key}.{field}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                samples += 1
    return samples


# The wheel's platform tag: glibc 2.28 or later (build-support/linker).
GLIBC_OF_TAG = (2, 28)


def glibc_needs(library: Path) -> tuple[tuple[int, ...], list[str]]:
    """Read from the ELF file: the highest ``GLIBC_x.y`` version the
    library's symbols need, and its undefined symbols that carry no version
    and are not CPython's (which the interpreter provides) nor weak: a C
    function that glibc 2.28 lacks would be one, failing only at load."""
    from elftools.elf.elffile import ELFFile

    with library.open("rb") as file:
        elf = ELFFile(file)
        needs = [
            tuple(int(part) for part in aux.name.removeprefix("GLIBC_").split("."))
            for _, auxes in elf.get_section_by_name(".gnu.version_r").iter_versions()
            for aux in auxes
            if aux.name.startswith("GLIBC_") and aux.name[6:7].isdigit()
        ]
        symbols = elf.get_section_by_name(".dynsym")
        versions = elf.get_section_by_name(".gnu.version")
        unversioned = [
            symbol.name
            for index, symbol in enumerate(symbols.iter_symbols())
            if symbol.name
            and symbol["st_shndx"] == "SHN_UNDEF"
            and symbol["st_info"]["bind"] != "STB_WEAK"
            and versions.get_symbol(index)["ndx"] in ("VER_NDX_LOCAL", "VER_NDX_GLOBAL", 0, 1)
            and not symbol.name.startswith(("Py", "_Py"))
        ]
    return max(needs), unversioned


# Neither make's nor this test's Python path reaches the commands run.
ENV = {k: v for k, v in os.environ.items() if not k.startswith("MAKE") and k != "PYTHONPATH"}


def run(
    *args: str | Path,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = TIMEOUT,
) -> tuple[str, str]:
    """Runs a command (bounded in time); its stdout and stderr."""
    proc = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=env or ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, (
        f"{args}\nstdout:\n{proc.stdout[-8000:]}\nstderr:\n{proc.stderr[-8000:]}"
    )
    return proc.stdout, proc.stderr


@pytest.mark.timeout(900)  # a build and an install; `make test` shares the cores
def test_the_wheel_installs_into_a_fresh_virtualenv_and_runs_the_quickstart(tmp_path):
    timings: dict[str, float] = {}
    started = time.monotonic()
    # This environment's interpreter and packages: what `make develop` used,
    # so cargo finds the release build up to date. STAMP= keeps make from
    # installing anything.
    _, cargo = run("make", "-s", "wheel", f"VENV={sys.prefix}", "STAMP=", cwd=REPO_ROOT)
    timings["make wheel"] = time.monotonic() - started
    assert "Finished `release` profile" in cargo and "Compiling" not in cargo, cargo
    (wheel,) = (REPO_ROOT / "dist").glob("shardstream-*_x86_64.whl")
    assert re.fullmatch(r"shardstream-[\d.]+-cp310-abi3-manylinux_2_28_x86_64\.whl", wheel.name)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
        # One extension, the abi3 one: no stray development build.
        assert [n for n in names if n.endswith(".so")] == ["shardstream/_core.abi3.so"]
        archive.extract("shardstream/_core.abi3.so", tmp_path / "unpacked")
    highest, unversioned = glibc_needs(tmp_path / "unpacked" / "shardstream" / "_core.abi3.so")
    assert highest <= GLIBC_OF_TAG, f"the extension needs GLIBC_{'.'.join(map(str, highest))}"
    assert not unversioned, f"undefined symbols without a glibc version: {unversioned[:10]}"
    metadata_text = metadata.decode()
    assert "Requires-Python: >=3.10" in metadata_text
    assert re.search(r"^Requires-Dist: numpy", metadata_text, re.M)
    assert re.search(r"^Requires-Dist: torch.*extra == .torch.", metadata_text, re.M)
    # What a package index shows: URLs, license, classifiers, README.
    for label in ("Homepage", "Documentation", "Source", "Issues"):
        assert re.search(rf"^Project-URL: {label}, https://", metadata_text, re.M), label
    assert re.search(r"^License-Expression: Apache-2.0$", metadata_text, re.M)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    # libjpeg-turbo is linked in: its notices travel with the binary.
    assert any(n.endswith(".dist-info/licenses/THIRD_PARTY_NOTICES.md") for n in names), names
    assert "Classifier: Operating System :: POSIX :: Linux" in metadata_text
    assert "Description-Content-Type: text/markdown" in metadata_text
    audit, _ = run(Path(sys.prefix) / "bin" / "auditwheel", "show", wheel)
    assert "is consistent" in audit and "manylinux_2_28_x86_64" in audit, audit

    # A fresh virtualenv: no torch, no shardstream, no numpy.
    fresh = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(fresh)
    python = fresh / "bin" / "python"
    started = time.monotonic()
    run(python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", wheel)
    timings["pip install"] = time.monotonic() - started
    probe = "import importlib.util as u; print(u.find_spec('torch') is None, u.find_spec('numpy'))"
    no_torch, numpy_spec = run(python, "-c", probe)[0].split(" ", 1)
    assert no_torch == "True" and str(fresh) in numpy_spec

    command, code = quickstart()
    words = shlex.split(command)
    assert words[0] == "shardstream"
    samples = write_train_shards(tmp_path, words[2])
    run(fresh / "bin" / "shardstream", *words[1:], cwd=tmp_path)
    assert (tmp_path / words[-1]).is_file()

    # torch (optional extra) from this environment, after shardstream's own.
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(run(python, "-c", purelib)[0].strip())
    import torch

    (site / "zz-lent-torch.pth").write_text(f"{Path(torch.__file__).parents[1]}\n")
    script = tmp_path / "quickstart.py"
    script.write_text(
        code
        + "\nimport shardstream, shardstream._core\n"
        + "print('FROM', shardstream.__file__, shardstream._core.__file__)\n"
    )
    started = time.monotonic()
    out = run(python, script, cwd=tmp_path)[0].splitlines()
    timings["quickstart"] = time.monotonic() - started
    assert out[0] == str(samples)
    stats = ast.literal_eval(out[1])  # the printed ds.stats()
    assert stats["samples"] == 10 * samples and stats["errors_skipped"] == 0
    _, package, core = out[2].split()
    assert package.startswith(str(fresh)) and core.startswith(str(fresh))
    assert core.endswith("_core.abi3.so")

    # The DDP exactly-once check README shows, from the installed package
    # (no clone): 2 ranks under torchrun, each sample once, equal ranks.
    started = time.monotonic()
    out_dir = tmp_path / "ddp-keys"
    launch = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    out, _ = run(*launch, "-m", "shardstream.ddp_check", words[2], out_dir, cwd=tmp_path)
    timings["ddp_check"] = time.monotonic() - started
    assert "ok: 2 ranks read disjoint samples, as many each" in out, out
    records = [json.loads((out_dir / f"rank-{rank}.json").read_text()) for rank in range(2)]
    for record in records:
        assert record["stats"]["samples"] == len(record["keys"]) == samples // 2
    union = records[0]["keys"] + records[1]["keys"]
    assert len(set(union)) == len(union) == samples
    print("timings (s):", {k: round(v, 1) for k, v in timings.items()})


# After the wheel's test, on purpose: the sdist's build of shardstream's own
# crate replaces the release build's extension in target/ (the same file
# name), so the next `make wheel` compiles that crate again.
SDIST_TIMEOUT = 1500


@pytest.mark.timeout(SDIST_TIMEOUT + 60)  # its build is bounded by SDIST_TIMEOUT
def test_the_sdist_builds_with_pip_and_reads_a_dataset(tmp_path):
    """``make sdist`` makes a source distribution that pip builds (Rust
    present) into a fresh virtualenv, where it imports and reads a dataset:
    what a user on a platform without a wheel does.

    pip builds it as a user's pip would (an isolated build environment with
    maturin from the package index), from the unpacked sdist alone. Only
    cargo's target directory is this checkout's, with the linker `make
    develop` built with, so the dependencies `make test` compiled are reused;
    a profile setting for shardstream's own crate alone makes cargo compile
    that crate anew, from the sdist's sources (it would otherwise find the
    checkout's build of the same files up to date): no debug line tables
    and no optimisation, which compiles in a fraction of the time (the test
    proves that the sources build and read, not how fast)."""
    run("make", "-s", "sdist", f"VENV={sys.prefix}", "STAMP=", cwd=REPO_ROOT)
    (sdist,) = (REPO_ROOT / "dist").glob("shardstream-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for needed in (
        "Cargo.toml",
        "Cargo.lock",
        "pyproject.toml",
        "src/lib.rs",
        "LICENSE",
        "THIRD_PARTY_NOTICES.md",
    ):
        assert needed in names, needed
    assert "python/shardstream/__init__.py" in names and "python/shardstream/py.typed" in names
    assert not [n for n in names if n.startswith(("target/", ".venv/", "dist/", "build/"))]
    assert not [n for n in names if n.endswith(".so")]
    # The repository's linker set-up (zig for the manylinux wheel) stays
    # out: a user's build links as cargo does.
    assert ".cargo/config.toml" not in names

    fresh = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(fresh)
    python = fresh / "bin" / "python"
    env = dict(
        ENV,
        CARGO_TARGET_DIR=str(REPO_ROOT / "target"),
        CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER=str(REPO_ROOT / "build-support" / "linker"),
        MATURIN_PEP517_ARGS=" ".join(
            f"--config profile.release.package.shardstream.{setting}"
            for setting in ("debug=false", "opt-level=0")
        ),
    )
    install = [python, "-m", "pip", "install", "--verbose", "--disable-pip-version-check", sdist]
    log = "".join(run(*install, cwd=tmp_path, env=env, timeout=SDIST_TIMEOUT))
    # Built here, from the sdist's sources, not taken from a wheel.
    assert "Compiling shardstream" in log, log[-4000:]
    assert "Successfully installed" in log and "shardstream" in log

    where = "import shardstream._core as c; print(c.__file__)"
    core = run(python, "-c", where, cwd=tmp_path)[0].strip()
    assert core.startswith(str(fresh)), core
    version, _ = run(fresh / "bin" / "shardstream", "--version", cwd=tmp_path)
    assert version.startswith("shardstream ")
    check = REPO_ROOT / "build-support" / "read_check.py"
    out = run(python, check, tmp_path / "data", "x86_64", cwd=tmp_path)[0]
    assert "x86_64: 100 samples over 2 ranks, each once, byte for byte" in out, out

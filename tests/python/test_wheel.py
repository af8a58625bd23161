"""``make wheel`` packs the release build into a wheel that installs with pip
into a fresh virtualenv and runs README's quickstart there.

The fresh virtualenv gets the wheel and its declared dependencies (numpy,
from the package index) by pip; torch, an optional extra of several GB with
its CUDA libraries, is lent by this test's own environment through a ``.pth``
file, after the install and after the ``shardstream`` command has run
without it.
"""

from __future__ import annotations

import ast
import io
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


# Neither make's nor this test's Python path reaches the commands run.
ENV = {k: v for k, v in os.environ.items() if not k.startswith("MAKE") and k != "PYTHONPATH"}


def run(*args: str | Path, cwd: Path | None = None) -> tuple[str, str]:
    """Runs a command (bounded in time); its stdout and stderr."""
    proc = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, f"{args}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout, proc.stderr


def test_the_wheel_installs_into_a_fresh_virtualenv_and_runs_the_quickstart(tmp_path):
    timings: dict[str, float] = {}
    started = time.monotonic()
    # This environment's interpreter and packages: what `make develop` used,
    # so cargo finds the release build up to date. STAMP= keeps make from
    # installing anything.
    _, cargo = run("make", "-s", "wheel", f"VENV={sys.prefix}", "STAMP=", cwd=REPO_ROOT)
    timings["make wheel"] = time.monotonic() - started
    assert "Finished `release` profile" in cargo and "Compiling" not in cargo, cargo
    (wheel,) = (REPO_ROOT / "dist").glob("shardstream-*.whl")
    assert re.fullmatch(r"shardstream-[\d.]+-cp310-abi3-manylinux_2_\d+_x86_64\.whl", wheel.name)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    # One extension, the abi3 one: no stray development build.
    assert [n for n in names if n.endswith(".so")] == ["shardstream/_core.abi3.so"]
    metadata_text = metadata.decode()
    assert "Requires-Python: >=3.10" in metadata_text
    assert re.search(r"^Requires-Dist: numpy", metadata_text, re.M)
    assert re.search(r"^Requires-Dist: torch.*extra == .torch.", metadata_text, re.M)
    audit, _ = run(Path(sys.prefix) / "bin" / "auditwheel", "show", wheel)
    assert "is consistent" in audit and "manylinux_2_" in audit, audit

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
    print("timings (s):", {k: round(v, 1) for k, v in timings.items()})

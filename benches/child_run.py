"""A benchmark's measurement in a fresh subprocess: the benchmark's script
run again with its ``--child`` arguments, its result the JSON object on the
last line of what it prints. Each run starts cold (imports, threads and
allocator of its own), so runs do not warm each other."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class ChildFailed(RuntimeError):
    """The child exited with an error: the message holds its exit status
    and the end of its stderr."""


def run_child(
    script: str | Path,
    child: Sequence[str],
    *,
    before: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 1800,
) -> dict[str, Any]:
    """Runs ``python SCRIPT [BEFORE...] --child CHILD...`` and returns the
    JSON object it printed last; ``ChildFailed`` when it fails."""
    out = subprocess.run(
        [sys.executable, str(script), *before, "--child", *child],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else dict(env),
        check=False,
    )
    if out.returncode != 0:
        what = " ".join(child)[:200]
        raise ChildFailed(f"{what} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])

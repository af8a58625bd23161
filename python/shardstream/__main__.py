"""The ``shardstream`` command line: ``bench`` runs in Python
(``shardstream.bench``), the other commands (``inspect``, ``index``,
``plan``, ...) in the Rust core."""

from __future__ import annotations

import sys

from ._core import run_cli


def main() -> None:
    """Runs the command line with ``sys.argv`` and exits with its code."""
    if sys.argv[1:2] == ["bench"]:
        from .bench import main as bench

        sys.exit(bench(sys.argv[2:]))
    try:
        code = run_cli(["shardstream", *sys.argv[1:]])
    except KeyboardInterrupt:
        print("shardstream: interrupted", file=sys.stderr)
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()

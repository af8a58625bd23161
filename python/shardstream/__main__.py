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
    code = run_cli(["shardstream", *sys.argv[1:]])
    if sys.argv[1:] in (["--help"], ["-h"], ["help"]):
        print(
            "The bench command (Python): shardstream bench SPEC [--workers N] [--batch-size B] "
            "[--decode FIELD=DECODER] [--epochs E | --samples S | --seconds T] [--json]: "
            "samples/s, MB/s, CPU per sample and the stage that bounds the loader; "
            "shardstream bench --help for every option"
        )
    sys.exit(code)


if __name__ == "__main__":
    main()

"""The ``shardstream`` command line (``inspect``, ``plan``)."""

from __future__ import annotations

import sys

from ._core import run_cli


def main() -> None:
    """Runs the command line with ``sys.argv`` and exits with its code."""
    sys.exit(run_cli(["shardstream", *sys.argv[1:]]))


if __name__ == "__main__":
    main()

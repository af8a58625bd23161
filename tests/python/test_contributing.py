"""CONTRIBUTING.md's maps follow the tree: every Rust module file and folder
under ``src/``, every module of ``python/shardstream/``, every file of the
test suite (``tests/python/*.py``; the Rust tests are in ``src/``) and every benchmark under
``benches/`` is named there as a path in backquotes, and every repository
path it names, in backquotes or as a link, exists.

A file added, moved or removed without its line in CONTRIBUTING.md fails
here, naming the paths. Text only: no build, no import of the extension.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTRIBUTING = REPO / "CONTRIBUTING.md"

# The folders whose paths CONTRIBUTING.md names and this test checks.
CHECKED_ROOTS = (
    "src",
    "python",
    "tests",
    "benches",
    "examples",
    "schemas",
    "docs",
    "build-support",
    ".ci",
    ".cargo",
)
ROOTS = "|".join(re.escape(root) for root in CHECKED_ROOTS)
REPO_PATH = re.compile(rf"(?:{ROOTS})(?:/[\w.-]+)*/?")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK_TARGET = re.compile(r"\]\(([^)\s]+)\)")


def code_spans(text: str) -> set[str]:
    """The text of every inline code span (between backquotes)."""
    return set(CODE_SPAN.findall(text))


def relative(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def rust_modules(root: Path) -> list[str]:
    """Every ``.rs`` file under ``src/``, and every folder holding one
    (written with a trailing ``/``)."""
    src = root / "src"
    files = sorted(src.rglob("*.rs"))
    folders = sorted({f.parent for f in files} - {src})
    return [relative(f, root) for f in files] + [relative(d, root) + "/" for d in folders]


def python_modules(root: Path) -> list[str]:
    package = root / "python" / "shardstream"
    return [relative(f, root) for f in sorted([*package.glob("*.py"), *package.glob("*.pyi")])]


def suite_files(root: Path) -> list[str]:
    tests = root / "tests"
    files = [*tests.glob("*.rs"), *(tests / "python").glob("*.py")]
    return [relative(f, root) for f in sorted(files)]


def benchmark_files(root: Path) -> list[str]:
    benches = root / "benches"
    files = [*benches.glob("*.py"), *benches.glob("*.rs"), *(benches / "peers").glob("*.py")]
    return [relative(f, root) for f in sorted(files)]


def unnamed(paths: list[str], text: str) -> list[str]:
    """The paths that the text does not name in backquotes."""
    spans = code_spans(text)
    return [p for p in paths if p not in spans]


def named_repository_paths(text: str) -> set[str]:
    """Every repository path the text names: code spans that are a path
    under one of ``CHECKED_ROOTS``, and relative link targets."""
    named = {span for span in code_spans(text) if REPO_PATH.fullmatch(span)}
    for target in LINK_TARGET.findall(text):
        if not re.match(r"[a-z]+:", target) and not target.startswith("#"):
            named.add(target.split("#", 1)[0])
    return named


def missing_paths(text: str, root: Path) -> list[str]:
    """The repository paths the text names that do not exist under root."""
    return sorted(p for p in named_repository_paths(text) if not (root / p).exists())


def contributing() -> str:
    return CONTRIBUTING.read_text(encoding="utf-8")


def test_module_map_names_every_rust_module_and_folder():
    modules = rust_modules(REPO)
    assert "src/lib.rs" in modules and "src/source/" in modules
    missing = unnamed(modules, contributing())
    assert not missing, f"CONTRIBUTING.md's module map does not name {missing}"


def test_module_map_names_every_python_module():
    modules = python_modules(REPO)
    assert "python/shardstream/dataset.py" in modules
    missing = unnamed(modules, contributing())
    assert not missing, f"CONTRIBUTING.md's module map does not name {missing}"


def test_test_map_names_every_test_file():
    files = suite_files(REPO)
    assert "tests/python/test_contributing.py" in files and "tests/python/test_api.py" in files
    missing = unnamed(files, contributing())
    assert not missing, f"CONTRIBUTING.md's test map does not name {missing}"


def test_benchmark_map_names_every_benchmark():
    files = benchmark_files(REPO)
    assert "benches/micro.rs" in files
    missing = unnamed(files, contributing())
    assert not missing, f"CONTRIBUTING.md's benchmark map does not name {missing}"


def test_every_path_contributing_names_exists():
    text = contributing()
    assert "src/lib.rs" in named_repository_paths(text)
    missing = missing_paths(text, REPO)
    assert not missing, f"CONTRIBUTING.md names paths that do not exist: {missing}"


def test_checks_fail_on_a_stale_map(tmp_path: Path):
    """The checks above fail on a map that misses a file or names a gone one."""
    (tmp_path / "src" / "store").mkdir(parents=True)
    (tmp_path / "src" / "lib.rs").write_text("//! root\n")
    (tmp_path / "src" / "store" / "mod.rs").write_text("//! stores\n")
    text = "- `src/lib.rs`: the root.\n- `src/gone.rs`: removed.\n- [x](docs/gone.md)\n"
    assert unnamed(rust_modules(tmp_path), text) == ["src/store/mod.rs", "src/store/"]
    assert missing_paths(text, tmp_path) == ["docs/gone.md", "src/gone.rs"]

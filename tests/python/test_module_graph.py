"""The Rust modules form a graph without cycles.

Every ``crate::name`` path in ``src/**/*.rs`` (``use`` lines, paths in code
and doc links alike, ``use crate::{a, b::c}`` groups included) is an arrow
from the top-level module of its file to the top-level module ``name``;
names that ``lib.rs`` re-exports (``crate::Error``) point at the module
they come from. ``python`` and ``cli`` sit on top and may import anything,
so nothing may import them. No two modules may reach each other: a module
that imports one that imports it back fails this test, which names the
cycle and the lines that make it.
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
TOP = {"python", "cli"}

Graph = dict[str, set[str]]
Where = dict[tuple[str, str], list[str]]


def top_module(path: Path, src: Path) -> str:
    """The top-level module a file belongs to (``crate`` for lib.rs)."""
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return parts[0] if parts else "crate"


def group_heads(text: str, open_at: int) -> tuple[list[str], int]:
    """The first name of each item of the brace group opening at
    ``text[open_at]`` (nested groups taken whole), and where it closes."""
    depth, start, heads = 0, open_at + 1, []
    for i in range(open_at, len(text)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                heads.append(text[start:i])
                return [m.group(1) for h in heads if (m := re.match(r"\s*(\w+)", h))], i
        elif c == "," and depth == 1:
            heads.append(text[start:i])
            start = i + 1
    raise AssertionError(f"unclosed `crate::{{` group at {open_at}")


def crate_paths(text: str) -> list[tuple[str, int]]:
    """Each ``crate::name`` (and each head of a ``crate::{...}`` group) in
    ``text``, with its line number."""
    found = []
    for m in re.finditer(r"\bcrate::(\w+|\{)", text):
        line = text.count("\n", 0, m.start()) + 1
        if m.group(1) == "{":
            heads, _ = group_heads(text, m.end() - 1)
            found.extend((h, line) for h in heads)
        else:
            found.append((m.group(1), line))
    return found


def reexports(lib: str) -> dict[str, str]:
    """Names ``lib.rs`` re-exports (``pub use module::{A, B}``) -> module."""
    out = {}
    for m in re.finditer(r"pub use (\w+)::(\{[^}]*\}|\w+);", lib):
        for name in re.findall(r"\w+", m.group(2)):
            out[name] = m.group(1)
    return out


def module_graph(src: Path) -> tuple[Graph, Where, set[str]]:
    """Arrows between top-level modules, the lines behind each arrow, and
    the modules ``lib.rs`` declares."""
    lib = (src / "lib.rs").read_text()
    modules = set(re.findall(r"^\s*pub(?:\(crate\))? mod (\w+);", lib, re.M))
    aliases = reexports(lib)
    graph: Graph = defaultdict(set)
    where: Where = defaultdict(list)
    for path in sorted(src.rglob("*.rs")):
        module = top_module(path, src)
        if module not in modules:
            continue  # lib.rs itself, src/bin/
        for name, line in crate_paths(path.read_text()):
            target = name if name in modules else aliases.get(name)
            if target is None or target == module:
                continue
            graph[module].add(target)
            where[(module, target)].append(f"{path.relative_to(src.parent)}:{line}")
    return graph, where, modules


def module_paths(src: Path) -> dict[str, Path]:
    """Every module of the crate by its path (``source::queue``; ``crate``
    for lib.rs) -> its file; src/bin/ is not part of the library."""
    out = {}
    for path in sorted(src.rglob("*.rs")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[0] == "bin":
            continue
        if parts[-1] in ("mod", "lib"):
            parts = parts[:-1]
        out["::".join(parts) or "crate"] = path
    return out


def production_text(text: str) -> str:
    """A file's text before its ``#[cfg(test)] mod tests`` (test code may
    reach anywhere: it is not part of the library's graph), with
    visibilities (``pub(in crate::source)``, which name no import) blanked."""
    m = re.search(r"^\s*#\[cfg\(test\)\]\s*\n\s*mod \w+\s*\{", text, re.M)
    text = text[: m.start()] if m else text
    return re.sub(r"pub\(in [\w:]+\)", lambda v: " " * len(v.group(0)), text)


def tree_paths(text: str, open_at: int) -> tuple[list[str], int]:
    """The paths of the use tree whose brace group opens at
    ``text[open_at]``, expanded (``{a::{b, c}, d}`` -> ``a::b``, ``a::c``,
    ``d``), and where the group closes."""
    paths, prefix, i, item = [], "", open_at + 1, ""
    while i < len(text):
        c = text[i]
        if c == "{":
            inner, i = tree_paths(text, i)
            head = re.sub(r"\s+", "", item).rstrip(":")
            paths.extend(f"{head}::{p}" if head else p for p in inner)
            item = ""
        elif c in ",}":
            head = re.sub(r"\s+", "", item)
            if head:
                paths.append(prefix + re.split(r"\bas\b", head)[0].strip())
            item = ""
            if c == "}":
                return paths, i
        else:
            item += c
        i += 1
    raise AssertionError(f"unclosed brace group at {open_at}")


def rooted_paths(text: str) -> list[tuple[str, int, int]]:
    """Each path beginning with ``crate``, ``super`` or ``self`` in
    ``text`` (brace groups expanded), with its line number and offset."""
    found = []
    pattern = r"(?<![\w:])((?:crate|super|self)(?:::(?:\w+|\{))+)"
    for m in re.finditer(pattern, text):
        line = text.count("\n", 0, m.start()) + 1
        path = m.group(1)
        if path.endswith("{"):
            inner, _ = tree_paths(text, m.end() - 1)
            found.extend(
                (f"{path[:-3]}::{p}" if p != "self" else path[:-3], line, m.start()) for p in inner
            )
        else:
            found.append((path, line, m.start()))
    return found


def inline_module_spans(text: str) -> list[tuple[int, int]]:
    """Where each inline module (``mod x { ... }``) of a file begins and
    ends."""
    spans = []
    for m in re.finditer(r"(?<![\w:])mod \w+\s*\{", text):
        depth = 0
        for i in range(m.end() - 1, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                spans.append((m.start(), i))
                break
    return spans


def child_modules(text: str) -> set[str]:
    """The submodules a file declares (``mod x;``, ``pub mod x;``)."""
    return set(re.findall(r"^\s*(?:pub(?:\([\w:]+\))?\s+)?mod (\w+);", text, re.M))


def parent(module: str) -> str:
    return module.rpartition("::")[0] or "crate"


def join(module: str, name: str) -> str:
    return name if module == "crate" else f"{module}::{name}"


class Resolver:
    """Where a path leads: the deepest module it names, names re-exported
    by ``pub use`` followed to the module that defines them."""

    def __init__(self, modules: dict[str, Path]):
        self.modules = modules
        self.exports: dict[tuple[str, str], str] = {}
        for module, path in modules.items():
            text = production_text(path.read_text())
            # `#[macro_export]` puts a macro at the crate's root.
            macros = r"#\[macro_export\]\s*(?:#\[[^\]]*\]\s*)*macro_rules!\s*(\w+)"
            for name in re.findall(macros, text):
                self.exports[("crate", name)] = module
            children = child_modules(text)
            for m in re.finditer(r"^\s*pub(?:\([\w:]+\))? use ([^;]+);", text, re.M):
                tree = m.group(1).strip()
                if "{" in tree:
                    at = tree.index("{")
                    head = tree[:at].rstrip(":")
                    inner, _ = tree_paths(tree, at)
                    items = [f"{head}::{p}" if head else p for p in inner]
                else:
                    items = [tree]
                for item in items:
                    item = re.split(r"\s+as\s+", item)[0]
                    name = item.rsplit("::", 1)[-1]
                    first = item.split("::", 1)[0]
                    if first in children:
                        item = "self::" + item
                    if first in ("crate", "super", "self") or first in children:
                        self.exports[(module, name)] = self.module_of(module, item)

    def module_of(self, module: str, path: str, depth: int = 0) -> str:
        """The module that ``path``, written in ``module``, leads to."""
        parts = path.split("::")
        at = module
        while parts and parts[0] in ("crate", "super", "self"):
            head = parts.pop(0)
            at = "crate" if head == "crate" else parent(at) if head == "super" else at
        for part in parts:
            if join(at, part) in self.modules:
                at = join(at, part)
                continue
            alias = self.exports.get((at, part))
            if alias is not None and depth < 8 and alias != at:
                return alias
            break
        return at


def every_module_graph(src: Path) -> tuple[Graph, Where]:
    """Arrows between every pair of modules (folders' modules and their
    files included): ``crate::``, ``super::`` and ``self::`` paths, and a
    parent's paths through its own submodules (``queue::Part`` in
    ``source/mod.rs``), each to the deepest module it names."""
    modules = module_paths(src)
    resolver = Resolver(modules)
    graph: Graph = defaultdict(set)
    where: Where = defaultdict(list)
    for module, path in modules.items():
        text = production_text(path.read_text())
        paths = rooted_paths(text)
        for child in child_modules(text):
            for m in re.finditer(rf"(?<![\w:]){child}::", text):
                line = text.count("\n", 0, m.start()) + 1
                paths.append((f"self::{child}", line, m.start()))
        inline = inline_module_spans(text)
        for rooted, line, at in paths:
            # `super::` inside `mod x { ... }` of this file names this file's module.
            depth = sum(start <= at < end for start, end in inline)
            while depth and rooted.startswith("super::"):
                rooted, depth = "self::" + rooted[len("super::") :], depth - 1
            target = resolver.module_of(module, rooted)
            if target == module:
                continue
            graph[module].add(target)
            where[(module, target)].append(f"{path.relative_to(src.parent)}:{line}")
    return graph, where


def components(graph: Graph) -> list[list[str]]:
    """Strongly connected components of ``graph`` (Tarjan, iterative)."""
    nodes = sorted(set(graph) | {w for ws in graph.values() for w in ws})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    out.append(sorted(comp))
    return out


def a_cycle(graph: Graph, comp: list[str]) -> list[str]:
    """One cycle through the first module of ``comp`` (a component of two
    or more modules), as the modules along it, first repeated last."""
    inside, start = set(comp), comp[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if w in inside and w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{comp} is not a cycle")


def describe_cycles(graph: Graph, where: Where) -> str:
    """Each cycle of ``graph`` with the lines behind its arrows; empty when
    there is none."""
    lines = []
    for comp in components(graph):
        if len(comp) < 2:
            continue
        cycle = a_cycle(graph, comp)
        lines.append(f"modules {', '.join(comp)} import each other: {' -> '.join(cycle)}")
        for a, b in itertools.pairwise(cycle):
            sites = where.get((a, b), [])
            lines.append(f"  {a} -> {b}: {', '.join(sites[:3])}")
    return "\n".join(lines)


def test_no_module_imports_one_that_imports_it_back():
    graph, where, modules = module_graph(SRC)
    assert len(modules) > 10 and sum(map(len, graph.values())) > 20, "the graph was not read"
    report = describe_cycles(graph, where)
    assert not report, "import cycle between Rust modules:\n" + report


def test_nothing_imports_the_bindings_or_the_command_line():
    graph, where, _ = module_graph(SRC)
    back = [
        f"{a} -> {b}: {', '.join(where[(a, b)][:3])}"
        for a, targets in sorted(graph.items())
        if a not in TOP
        for b in sorted(targets & TOP)
    ]
    assert not back, "modules import the top-level front ends:\n" + "\n".join(back)


def test_the_check_finds_cycles_and_reads_groups(tmp_path: Path):
    """The checker itself: a group import, a nested group, a re-exported
    name and a path in code make arrows, and a cycle through them fails."""
    src = tmp_path / "src"
    (src / "b").mkdir(parents=True)
    (src / "lib.rs").write_text(
        "pub mod a;\npub mod b;\npub mod c;\npub mod d;\npub use d::{Thing, Other};\n"
    )
    (src / "a.rs").write_text("use crate::{\n    b::{self, x::Y},\n    Thing,\n};\n")
    (src / "b" / "mod.rs").write_text("fn f() { let _ = crate::c::g(); }\n")
    (src / "c.rs").write_text("/// See [`crate::a`].\npub fn g() {}\n")
    (src / "d.rs").write_text("pub struct Thing;\npub struct Other;\n")
    graph, where, _ = module_graph(src)
    assert graph == {"a": {"b", "d"}, "b": {"c"}, "c": {"a"}}
    assert where[("a", "d")] == ["src/a.rs:1"]
    report = describe_cycles(graph, where)
    assert "a -> b -> c -> a" in report, report
    assert "c -> a: src/c.rs:1" in report, report
    (src / "c.rs").write_text("pub fn g() {}\n")
    assert describe_cycles(*module_graph(src)[:2]) == ""


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        (
            {"a": {"b"}, "b": {"c"}, "c": {"b", "d"}, "d": {"e"}, "e": {"d"}},
            [["b", "c"], ["d", "e"]],
        ),
    ],
)
def test_components(graph: Graph, expected: list[list[str]]):
    found = sorted(c for c in components(graph) if len(c) > 1)
    assert found == expected


def test_no_module_of_any_depth_imports_one_that_imports_it_back():
    """The same for every module, folders' files included: a child that
    imports from its parent while the parent imports from it is a cycle."""
    graph, where = every_module_graph(SRC)
    assert len(graph) > 40 and sum(map(len, graph.values())) > 100, "the graph was not read"
    report = describe_cycles(graph, where)
    assert not report, "import cycle between Rust modules:\n" + report


def test_the_every_module_check_sees_parents_children_and_reexports(tmp_path: Path):
    src = tmp_path / "src"
    (src / "s").mkdir(parents=True)
    (src / "lib.rs").write_text("pub mod s;\npub mod t;\n")
    (src / "s" / "mod.rs").write_text(
        "mod q;\nmod c;\npub use c::Chunk;\nfn f() { let _ = q::Part::new(); }\n"
        "#[cfg(test)]\nmod tests {\n    use crate::t::X;\n}\n"
    )
    # A visibility names no import.
    (src / "s" / "c.rs").write_text("pub struct Chunk;\npub(in crate::s) struct Inner;\n")
    (src / "s" / "q.rs").write_text("use super::{c::Chunk, Other};\npub struct Part;\n")
    (src / "t.rs").write_text("use crate::s::{self, Chunk};\n")
    graph, where = every_module_graph(src)
    # `super::Other` names the parent; `crate::s::Chunk` leads to s::c; the
    # test module's import of t is not an arrow.
    assert graph == {"s": {"s::q", "s::c"}, "s::q": {"s::c", "s"}, "t": {"s", "s::c"}}
    report = describe_cycles(graph, where)
    assert "s -> s::q -> s" in report, report
    assert "s::q -> s: src/s/q.rs:1" in report, report
    (src / "s" / "q.rs").write_text("use super::c::Chunk;\npub struct Part;\n")
    assert describe_cycles(*every_module_graph(src)) == ""


# What a store (``src/store/``: local files, S3, HTTP(S), GCS, the Hub)
# may not import: the read-ahead that reads through it, and every stage
# above that. A store knows of objects and byte ranges, not of chunks,
# budgets, shards being parsed or slots.
ABOVE_THE_STORES = ("source", "pipeline", "format", "plan", "dataset", "index", "write")


def test_stores_never_import_the_read_ahead_or_what_reads_through_it():
    graph, where = every_module_graph(SRC)
    stores = [m for m in graph if m == "store" or m.startswith("store::")]
    assert {"store::s3", "store::http", "store::local", "store::gcs", "store::hub"} <= set(
        module_paths(SRC)
    ), "a backend is missing from src/store/"
    assert stores, "the graph was not read"
    upward = [
        f"{m} -> {t}: {', '.join(where[(m, t)][:3])}"
        for m in sorted(stores)
        for t in sorted(graph[m])
        if t.split("::")[0] in ABOVE_THE_STORES
    ]
    assert not upward, "store modules import the layers above them:\n" + "\n".join(upward)
    # And the read-ahead does reach the stores through them.
    assert any(t.startswith("store") for m in graph if m.startswith("source") for t in graph[m])


def test_the_http_client_imports_none_of_the_backends_it_carries():
    """``store`` is one way inside too: the HTTP(S) client is the transport
    of the GCS and Hub backends, which give it their credentials
    (``OriginCredentials``); it imports none of them."""
    graph, where = every_module_graph(SRC)
    http = [m for m in graph if m == "store::http" or m.startswith("store::http::")]
    assert http, "the graph was not read"
    upward = [
        f"{m} -> {t}: {', '.join(where[(m, t)][:3])}"
        for m in sorted(http)
        for t in sorted(graph[m])
        if t.startswith(("store::gcs", "store::hub"))
    ]
    assert not upward, "the HTTP(S) client imports the backends above it:\n" + "\n".join(upward)
    for backend in ("store::gcs", "store::hub"):
        assert any(t.startswith("store::http") for t in graph.get(backend, ())), backend

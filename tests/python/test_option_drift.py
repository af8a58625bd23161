"""The dataset options are defined once, in the Rust core's option table
(``shardstream._core.option_table()``: name, Python type, default, text and
whether the option decides the sample order). Every other face of them must
agree with it, or a test here fails naming the option: the defaults listing,
the parser, ``shardstream.options.DatasetOptions``, the stub,
``StreamingDataset``'s docstring and README's options table. The fields of
``s3=`` (``shardstream.S3Config``) are held the same way to
``shardstream._core.s3_option_table()`` and docs/sources.md's table.

README's and docs/sources.md's tables are generated from the option tables:
after a change, run ``SHARDSTREAM_BLESS=1 pytest
tests/python/test_option_drift.py`` and review the diff.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import os
import re
import tarfile
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import pytest

import shardstream
from shardstream import _core
from shardstream.options import DatasetOptions
from shardstream.s3 import S3Config

TABLE = _core.option_table()
NAMES = [option["name"] for option in TABLE]
S3_TABLE = _core.s3_option_table()
REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
SOURCES = REPO / "docs" / "sources.md"
STUB = Path(shardstream.__file__).with_name("_core.pyi")

# The names the table's Python types are written with.
NAMESPACE = {
    "Any": Any,
    "AudioClip": _core.AudioClip,
    "Callable": Callable,
    "Image": _core.Image,
    "ImageBoxes": _core.ImageBoxes,
    "Literal": Literal,
    "Mapping": Mapping,
    "Pack": _core.Pack,
    "S3Config": S3Config,
    "Sequence": Sequence,
    "Tokenizer": _core.Tokenizer,
    "os": os,
}


def table_type(option: dict[str, Any]) -> Any:
    return eval(option["type"], dict(NAMESPACE))


def test_every_option_has_a_name_type_default_text_and_order_marker():
    assert len(set(NAMES)) == len(NAMES)
    for option in TABLE:
        assert set(option) == {"name", "type", "default", "doc", "affects_order", "order"}
        assert re.fullmatch(r"[a-z][a-z0-9_]*", option["name"]), option
        assert option["doc"], option["name"]
        assert isinstance(option["affects_order"], bool), option["name"]
        assert option["affects_order"] == (option["order"] != "no"), option["name"]
        table_type(option)


def test_the_order_markers_are_those_of_todays_fingerprint():
    """Which options a saved state must match: changing a marker changes
    which states resume, so it is a deliberate change of this list."""
    fingerprinted = {o["name"]: o["order"] for o in TABLE if o["order"] in ("holds", "decides")}
    assert fingerprinted == {
        "seed": "decides",
        "shuffle_shards": "decides",
        "shuffle_buffer": "decides",
        "shuffle_buffer_bytes": "decides",
        "shuffle_initial": "decides",
        "remainder": "decides",
        "pack": "decides",
        "decode": "holds",
        "columns": "holds",
    }
    assert {o["name"] for o in TABLE if o["order"] == "no"} >= {"sample_seed", "io_timeout"}


def test_the_defaults_listing_is_the_table():
    assert list(_core.default_options().items()) == [(o["name"], o["default"]) for o in TABLE]


def test_the_parser_takes_every_option_at_its_default_and_every_choice_of_its_type():
    for option in TABLE:
        name, default = option["name"], option["default"]
        given = _core.Options(**{name: default})
        assert given[name] == default and type(given[name]) is type(default), name
        if typing.get_origin(table_type(option)) is Literal:
            for choice in typing.get_args(table_type(option)):
                # (Arrow batches keep file order: no shuffle buffer.)
                _core.Options(**{name: choice, "shuffle_buffer": 0})
            with pytest.raises(ValueError, match=f"invalid option {name}"):
                _core.Options(**{name: "no-such-choice"})
    mapping = typing.get_args(table_type(TABLE[NAMES.index("decode")]))[1]
    per_field = typing.get_args(typing.get_args(mapping)[1])
    decoders = next(a for a in per_field if typing.get_origin(a) is Literal)
    for decoder in typing.get_args(decoders):
        _core.Options(decode={"x": decoder})
    with pytest.raises(TypeError, match="unknown option"):
        _core.Options(**{"no_such_option": 1})


def test_typed_dict_names_every_option_with_the_tables_type_in_its_order():
    hints = typing.get_type_hints(DatasetOptions)
    assert list(hints) == NAMES
    for option in TABLE:
        assert hints[option["name"]] == table_type(option), option["name"]


def test_the_stub_takes_the_options_as_the_typed_dict_and_restates_none():
    tree = ast.parse(STUB.read_text())
    options = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Options")
    new = next(n for n in options.body if isinstance(n, ast.FunctionDef) and n.name == "__new__")
    assert [a.arg for a in new.args.args] == ["cls"] and not new.args.kwonlyargs
    assert new.args.kwarg is not None
    assert ast.unparse(new.args.kwarg.annotation) == "Unpack[DatasetOptions]"


def test_the_dataset_docstring_describes_every_option_in_table_order():
    doc = shardstream.StreamingDataset.__doc__ or ""
    args = doc.split("Args:\n", 1)[1]
    described = []
    for line in args.splitlines():
        match = re.fullmatch(r" {8}([a-z][a-z0-9_]*(?:, [a-z][a-z0-9_]*)*):(?: .*)?", line)
        if match:
            described += [n.strip() for n in match.group(1).split(",")]
    slot = ["urls", "rank", "world_size", "num_workers", "worker_id"]
    assert [n for n in described if n not in slot] == NAMES


def shown(default: Any) -> str:
    """A default as README's table shows it: sizes in MiB, values as Python spells them."""
    if type(default) is int and default >= 1 << 20 and default % (1 << 20) == 0:
        return f"{default >> 20} MiB"
    if isinstance(default, str):
        return f'`"{default}"`'
    return f"`{default!r}`"


def markdown_table(table: list[dict[str, Any]], head: str) -> list[str]:
    return [head, "|---|---|---|"] + [
        f"| `{o['name']}` | {shown(o['default'])} | {o['doc']} |" for o in table
    ]


def check_generated(path: Path, heading: str, head: str, table: list[dict[str, Any]]) -> None:
    """The Markdown table under ``heading`` in ``path`` is made from ``table``
    (rewritten with ``SHARDSTREAM_BLESS=1``), and no other row of the file
    describes one of its options."""
    lines = path.read_text().split("\n")
    start = lines.index(heading)
    first = lines.index(head, start)
    end = first
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    expected = markdown_table(table, head)
    if os.environ.get("SHARDSTREAM_BLESS") == "1" and lines[first:end] != expected:
        lines[first:end] = expected
        path.write_text("\n".join(lines))
    assert lines[first:end] == expected, (
        f"{path.name}'s table under {heading!r} is made from the option table in "
        "src/config/table.rs: change the text there, rebuild, and run this test with "
        "SHARDSTREAM_BLESS=1"
    )
    for option in table:
        rows = [line for line in lines if line.startswith(f"| `{option['name']}` |")]
        assert len(rows) == 1, (option["name"], rows)


def test_readme_options_table_is_generated_from_the_table():
    check_generated(README, "## Options", "| option | default | meaning |", TABLE)


def test_s3_config_is_the_s3_table():
    fields = dataclasses.fields(S3Config)
    assert [f.name for f in fields] == [o["name"] for o in S3_TABLE]
    hints = typing.get_type_hints(S3Config)
    for field, option in zip(fields, S3_TABLE, strict=True):
        assert field.default == option["default"], field.name
        assert type(field.default) is type(option["default"]), field.name
        assert hints[field.name] == table_type(option), field.name
        _core.Options(s3={field.name: option["default"]})
    assert list(_core.default_s3_options().items()) == [(o["name"], o["default"]) for o in S3_TABLE]
    attributes = (S3Config.__doc__ or "").split("Attributes:\n", 1)[1]
    described = re.findall(r"^ {8}([a-z][a-z0-9_]*):", attributes, flags=re.M)
    assert described == [o["name"] for o in S3_TABLE]


def test_sources_s3_config_table_is_generated_from_the_s3_table():
    check_generated(
        SOURCES, "## `S3Config` fields", "| `S3Config` field | default | meaning |", S3_TABLE
    )


def identity(sample: Any) -> Any:
    return sample


# A value other than the default of each option, to check its order marker
# against what a saved state does: a new option must be given one here.
# None: the option cannot take another value on a plain tar dataset.
OTHER_VALUES: dict[str, Any] = {
    "seed": 1,
    "shuffle_shards": False,
    "shuffle_buffer": 10,
    "shuffle_buffer_bytes": 1 << 20,
    "shuffle_initial": 5,
    "read_ahead_bytes": 1 << 20,
    "on_error": "warn",
    "io_timeout": 5.0,
    "manifest": False,
    "remainder": "pad",
    "s3": {"max_attempts": 3},
    "http_headers": {"X-Test": "1"},
    "format": "tar",
    "decode": {"txt": "str"},
    "decode_threads": 2,
    "columns": ["a"],
    "batch_format": None,
    "batch_size": 2,
    "pack": shardstream.Pack(4, field="txt"),
    "pack_bytes": True,
    "local_bytes_by_reference": False,
    "worker_shared_memory_bytes": 0,
    "raise_malloc_thresholds": False,
    "read_next_epoch_early": False,
    "count_samples": True,
    "transform": identity,
    "sample_seed": True,
    "sample_ids": True,
    "model_parallel_size": 1,
    "cache_dir": "CACHE",
    "cache_limit_bytes": 1 << 30,
}


def test_a_state_resumes_with_an_option_changed_exactly_when_its_marker_says_so(tmp_path):
    """The markers are the fingerprint's only list: an option that decides
    the order (``holds``, ``decides``) refuses a state saved with another
    value; one marked ``no`` resumes it, and gives the samples in the same
    order as the default does."""
    assert list(OTHER_VALUES) == NAMES
    urls = []
    for s in range(2):
        path = tmp_path / f"shard-{s}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(5):
                body = f"sample {s} {i}".encode()
                info = tarfile.TarInfo(f"k{s}{i}.txt")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
        urls.append(str(path))

    def started(**options: Any) -> shardstream.StreamingDataset:
        ds = shardstream.StreamingDataset(urls, **options)
        next(iter(ds))
        return ds

    def keys(ds: shardstream.StreamingDataset) -> list[str]:
        out: list[str] = []
        for item in ds:
            key = item["__key__"]
            out += list(key) if not isinstance(key, str) else [key]
        return out

    saved = started().state_dict()
    order = keys(shardstream.StreamingDataset(urls))
    for option in TABLE:
        name, value = option["name"], OTHER_VALUES[option["name"]]
        if value is None or option["order"] in ("shards", "layout"):
            continue
        changed = {name: str(tmp_path / "cache") if value == "CACHE" else value}
        if name == "pack_bytes":
            changed["batch_size"] = 2
        if name == "cache_limit_bytes":
            changed["cache_dir"] = str(tmp_path / "cache")
        ds = shardstream.StreamingDataset(urls, **changed)
        if option["order"] == "no":
            assert keys(shardstream.StreamingDataset(urls, **changed)) == order, name
            ds.load_state_dict(saved)
            next(iter(ds))
        else:
            # The error names the option that differs.
            expected = rf"fingerprint: the state was saved for other options \({name} differs\)"
            with pytest.raises(shardstream.StateMismatchError, match=expected):
                ds.load_state_dict(saved)
                next(iter(ds))

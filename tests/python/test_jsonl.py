"""JSON-lines shards (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``): one
sample per line, its fields those of ``json.loads``; folders, brace ranges,
S3, ``shardstream index`` and counting, ranks, exact resume, and bad lines
named by shard, line and offset."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from _shardtest import tar_bytes
from s3_server import s3_config as config

from shardstream import DatasetSpecError, ShardFormatError, ShardSkippedWarning, StreamingDataset
from shardstream._core import run_cli

DOCS = [
    {"text": f"document {i} " + "é" * (i % 5), "n": i, "meta": {"tags": ["a", i], "w": i / 3}}
    for i in range(45)
]


def line_text(doc: dict[str, Any], crlf: bool = False) -> str:
    return json.dumps(doc, ensure_ascii=False) + ("\r\n" if crlf else "\n")


def write_shards(folder: Path) -> list[str]:
    """Three shards of 15 documents: plain (with blank lines, CRLF line
    breaks and no break after its last line), gzip and zstd."""
    folder.mkdir(parents=True, exist_ok=True)
    plain = "".join(line_text(d, crlf=i % 2 == 0) for i, d in enumerate(DOCS[:15]))
    plain = plain.replace("\n", "\n\n", 1).rstrip("\r\n") + "\n  \n"
    plain = plain.rstrip("\n ")  # the last line has no line break
    (folder / "a.jsonl").write_text(plain, encoding="utf-8")
    with gzip.open(folder / "b.jsonl.gz", "wt", encoding="utf-8") as out:
        out.write("".join(line_text(d) for d in DOCS[15:30]))
    zstd = zstandard.ZstdCompressor().compress("".join(line_text(d) for d in DOCS[30:]).encode())
    (folder / "c.jsonl.zst").write_bytes(zstd)
    return [str(folder / name) for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst")]


def fields(sample: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sample.items() if not k.startswith("__")}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_line_comes_once_with_the_fields_json_loads_gives(
    tmp_path: Path, num_workers: int
) -> None:
    urls = write_shards(tmp_path / "d")
    ds = StreamingDataset(urls, seed=3)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers)
    got = list(loader)
    assert len(got) == len(DOCS)
    by_n = {s["n"]: s for s in got}
    assert sorted(by_n) == list(range(len(DOCS)))
    for n, sample in by_n.items():
        assert fields(sample) == DOCS[n], sample
        shard = n // 15
        assert sample["__url__"] == urls[shard]
        assert sample["__key__"] == str(n % 15)
    assert [kind for kind in ds.shard_list.kinds] == ["jsonl"] * 3


def test_a_folder_is_read_as_jsonl_when_asked_and_never_by_auto(tmp_path: Path) -> None:
    """``format="auto"`` lists tar and Parquet names: a ``labels.jsonl``
    beside tar shards is not read as a shard. ``format="jsonl"`` lists the
    JSON-lines shards only."""
    folder = tmp_path / "mixed"
    write_shards(folder)
    (folder / "s-0.tar").write_bytes(tar_bytes([("k1.txt", b"x"), ("k2.txt", b"y")]))
    auto = StreamingDataset(str(folder))
    assert [Path(u).name for u, _ in auto.shards] == ["s-0.tar"]
    assert sorted(s["__key__"] for s in auto) == ["k1", "k2"]
    jsonl = StreamingDataset(str(folder), format="jsonl")
    names = [Path(u).name for u, _ in jsonl.shards]
    assert names == ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst"]
    assert len(list(jsonl)) == len(DOCS)
    with pytest.raises(ValueError, match='"jsonl"'):
        StreamingDataset(str(folder), format="json")


def indexed(tmp_path: Path, urls: list[str]) -> Path:
    manifest = tmp_path / "d" / "manifest.json"
    code = run_cli(["shardstream", "index", *urls, "--format", "jsonl", "-o", str(manifest)])
    assert code == 0
    return manifest


def test_index_gives_the_lines_spans_and_ranks_get_equal_shares(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    urls = write_shards(tmp_path / "d")
    manifest = json.loads(indexed(tmp_path, urls).read_text())
    assert [s["samples"] for s in manifest["shards"]] == [15, 15, 15]
    plain = (tmp_path / "d" / "a.jsonl").read_bytes()
    entry = manifest["shards"][0]
    for offset, length in zip(entry["offsets"], entry["lengths"], strict=True):
        assert json.loads(plain[offset : offset + length]) in DOCS
    # Three ranks, one worker each: 15 samples each, every line once.
    seen: Counter[int] = Counter()
    for rank in range(3):
        ds = StreamingDataset(urls, seed=5, rank=rank, world_size=3)
        samples = list(ds)
        assert len(samples) == len(ds) == 15
        seen.update(s["n"] for s in samples)
    assert seen == Counter(range(len(DOCS)))
    # Without --format jsonl, index takes the shards for tar.
    capfd.readouterr()
    code = run_cli(["shardstream", "index", urls[0], "-o", str(tmp_path / "m.json")])
    assert code == 1 and "not a tar archive" in capfd.readouterr().err


def test_local_plain_shards_are_counted_from_their_line_breaks(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Two ranks need counts: local plain JSON-lines shards are counted
    without a manifest (by a dataset and by ``shardstream plan``); a
    compressed one cannot be, and is named."""
    folder = tmp_path / "p"
    folder.mkdir()
    for shard in range(3):
        text = "".join(line_text(d) for d in DOCS[shard * 15 : shard * 15 + 15 - shard])
        (folder / f"p-{shard}.jsonl").write_text(text + "\n\n", encoding="utf-8")
    counts = []
    for rank in range(2):
        ds = StreamingDataset(str(folder), format="jsonl", rank=rank, world_size=2, seed=1)
        counts.append(len(list(ds)))
    assert counts == [21, 21]  # 42 lines, none dropped
    capfd.readouterr()
    plan = ["shardstream", "plan", str(folder), "--format", "jsonl", "--world-size", "2"]
    assert run_cli(plan) == 0
    out = capfd.readouterr().out
    assert "3 shards" in out and "21 samples per rank" in out and "local shards" in out, out
    urls = write_shards(tmp_path / "d")
    with pytest.raises(DatasetSpecError, match=r"b\.jsonl\.gz has none .*SPEC --format jsonl -o"):
        StreamingDataset(urls, rank=0, world_size=2)


@pytest.mark.parametrize("with_manifest", [False, True])
def test_a_state_saved_mid_epoch_resumes_exactly(tmp_path: Path, with_manifest: bool) -> None:
    urls = write_shards(tmp_path / "d")
    if with_manifest:
        indexed(tmp_path, urls)
    options = {"seed": 11, "shuffle_buffer": 6, "shuffle_initial": 2}
    whole = [s["n"] for s in StreamingDataset(urls, **options)]
    for taken in (0, 7, 22, 44):
        ds = StreamingDataset(urls, **options)
        it = iter(ds)
        first = [next(it)["n"] for _ in range(taken)]
        state = ds.state_dict()
        resumed = StreamingDataset(urls, **options)
        resumed.load_state_dict(state)
        assert first + [s["n"] for s in resumed] == whole, taken


def test_a_bad_line_is_named_and_warn_skips_the_rest_of_its_shard(tmp_path: Path) -> None:
    folder = tmp_path / "bad"
    folder.mkdir()
    good = folder / "good.jsonl"
    good.write_text("".join(line_text(d) for d in DOCS[:5]), encoding="utf-8")
    bad = folder / "bad.jsonl"
    head = "".join(line_text(d) for d in DOCS[5:8])
    bad.write_text(head + '{"text": "cut\n' + line_text(DOCS[8]), encoding="utf-8")
    with pytest.raises(ShardFormatError) as raised:
        list(StreamingDataset([str(bad)], shuffle_buffer=0))
    message = str(raised.value)
    assert str(bad) in message and "line 4 is invalid JSON" in message, message
    assert message.endswith(f"at byte offset {len(head.encode())}"), message
    ds = StreamingDataset([str(good), str(bad)], shuffle_buffer=0, on_error="warn", seed=2)
    with pytest.warns(ShardSkippedWarning, match="line 4"):
        got = sorted(s["n"] for s in ds)
    # The bad shard's lines before the bad one came; none after it.
    assert got == list(range(8))
    assert ds.stats()["errors_skipped"] == 1
    reserved = folder / "reserved.jsonl"
    reserved.write_text('{"__url__": "x", "text": "a"}\n', encoding="utf-8")
    with pytest.raises(ShardFormatError, match='line 1 has the field "__url__"'):
        list(StreamingDataset([str(reserved)]))


@pytest.mark.usefixtures("s3_credentials")
def test_shards_on_s3_by_prefix_and_brace_range(s3: Any, tmp_path: Path) -> None:
    urls = write_shards(tmp_path / "d")
    client = s3.client()
    client.create_bucket(Bucket="text")
    for url in urls:
        client.upload_file(url, "text", f"corpus/{Path(url).name}")
    client.put_object(Bucket="text", Key="corpus/notes.tar", Body=tar_bytes([("a.txt", b"x")]))
    prefix = StreamingDataset("s3://text/corpus/", format="jsonl", s3=config(s3), seed=4)
    assert [Path(u).name for u, _ in prefix.shards] == ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst"]
    loader = torch.utils.data.DataLoader(prefix, batch_size=None, num_workers=2)
    got = {s["n"]: fields(s) for s in loader}
    assert got == dict(enumerate(DOCS))
    named = StreamingDataset("s3://text/corpus/{a.jsonl,b.jsonl.gz}", s3=config(s3))
    assert sorted(s["n"] for s in named) == list(range(30))
    # Two ranks count the remote shards by reading them (count_samples),
    # keeping the counts and the shards read from their start (the
    # compressed ones) in the cache: the next start reads them from there.
    cache = tmp_path / "cache"
    for start in range(2):
        seen: Counter[int] = Counter()
        hits = 0
        for rank in range(2):
            ds = StreamingDataset(
                "s3://text/corpus/",
                format="jsonl",
                s3=config(s3),
                rank=rank,
                world_size=2,
                count_samples=True,
                cache_dir=str(cache),
            )
            samples = [s["n"] for s in ds]
            assert len(samples) == len(ds) == 22  # 45 lines, one dropped
            seen.update(samples)
            hits += ds.stats()["cache_hits"]
        assert len(seen) == 44 and set(seen.values()) == {1}
        assert hits >= 2 * start, hits


def test_the_command_line_inspects_a_jsonl_shard(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    urls = write_shards(tmp_path / "d")
    capfd.readouterr()
    assert run_cli(["shardstream", "inspect", urls[1]]) == 0
    out = capfd.readouterr().out.splitlines()
    assert out[-1].startswith("15 samples") and "gzip-compressed" in out[-1], out
    assert out[0].split("\t")[0] == "0", out


def test_an_elastic_resume_onto_another_world_size_gives_each_line_once(tmp_path: Path) -> None:
    """Two ranks stop after 4 and 9 samples; three ranks take over from the
    elastic state: equal shares, and no line twice (``remainder="drop"``
    leaves out fewer lines than the new ranks)."""
    import shardstream

    urls = write_shards(tmp_path / "d")
    indexed(tmp_path, urls)
    options: dict[str, Any] = {"seed": 7, "shuffle_buffer": 5, "shuffle_initial": 2}
    consumed: list[int] = []
    states = []
    for rank, taken in ((0, 4), (1, 9)):
        ds = StreamingDataset(urls, rank=rank, world_size=2, **options)
        it = iter(ds)
        consumed += [next(it)["n"] for _ in range(taken)]
        states.append(ds.state_dict())
    elastic = shardstream.elastic_state(*states)
    rest = []
    for rank in range(3):
        ds = StreamingDataset(urls, rank=rank, world_size=3, **options)
        ds.load_state_dict(elastic)
        rest.append([s["n"] for s in ds])
    assert len({len(r) for r in rest}) == 1, [len(r) for r in rest]
    seen = consumed + [n for r in rest for n in r]
    assert len(seen) == len(set(seen)), Counter(seen).most_common(3)
    assert len(DOCS) - len(seen) < 3

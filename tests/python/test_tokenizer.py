"""``shardstream.Tokenizer``: a ``tokenizer.json`` run on the decode threads,
giving for every sample the int32 ids the Python ``tokenizers`` package
gives for the same text (tokenizers trained here on generated text), from
JSON lines, Parquet text columns and tar text members alike."""

from __future__ import annotations

import json
import pickle
import random
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _shardtest import write_tar
from http_server import running_http_server
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as PyTokenizer

from shardstream import FieldDecodeError, StateMismatchError, StreamingDataset, Tokenizer

WORDS = [
    *("the", "a", "shard", "stream", "sample", "token", "epoch"),
    *("über", "naïve", "数据", "λόγος", "🙂", "resume", "rank"),
]


def generated_texts(count: int, seed: int) -> list[str]:
    """Texts of 0-60 words with punctuation, digits, tabs and newlines."""
    rng = random.Random(seed)
    texts = []
    for i in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randrange(0, 60))]
        if i % 3 == 0:
            words.append(f"{rng.randrange(10**6)}.")
        if i % 4 == 0:
            words.insert(len(words) // 2, "\n\t  ")
        texts.append(" ".join(words))
    return texts


TEXTS = generated_texts(60, seed=1)


def trained_byte_level(tok: PyTokenizer, special: str, seed: int) -> PyTokenizer:
    """``tok`` (its pre-tokenizer set) trained as a byte-level BPE of 400
    tokens on generated text, with ``special`` as a special token."""
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(generated_texts(500, seed=seed), trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PyTokenizer]:
    """A byte-level BPE (GPT-2's kind) of 400 tokens trained on generated
    text, with ``<|endoftext|>`` as a special token; its file and the
    Python tokenizer."""
    tok = PyTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained_byte_level(tok, "<|endoftext|>", seed=2)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path, tok


LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@pytest.fixture(scope="module")
def llama_style(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PyTokenizer]:
    """A byte-level BPE of Llama 3's form: its regex ``Split``, then
    ``ByteLevel`` without a regex, an NFC normalizer, and a template that
    puts ``<|begin_of_text|>`` first; its file and the Python tokenizer."""
    tok = PyTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trained_byte_level(tok, "<|begin_of_text|>", seed=4)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))],
    )
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path, tok


@pytest.fixture(scope="module")
def wordpiece() -> PyTokenizer:
    """A BERT-style WordPiece with ``[CLS] ... [SEP]`` added by its post-processor."""
    tok = PyTokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]"])
    tok.train_from_iterator(generated_texts(300, seed=3), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )
    return tok


def write_jsonl(folder: Path, texts: list[str], per_shard: int = 20) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    urls = []
    for start in range(0, len(texts), per_shard):
        path = folder / f"part-{start // per_shard}.jsonl"
        lines = [
            json.dumps({"text": t, "n": start + i}, ensure_ascii=False)
            for i, t in enumerate(texts[start : start + per_shard])
        ]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        urls.append(str(path))
    return urls


def test_ids_equal_the_python_tokenizers_for_every_document(tmp_path, byte_level):
    path, py = byte_level
    eos = py.token_to_id("<|endoftext|>")
    tokenizer = Tokenizer(path, eos="<|endoftext|>")
    assert (tokenizer.eos, tokenizer.bos, tokenizer.vocab_size) == (eos, None, 400)
    urls = write_jsonl(tmp_path / "d", TEXTS)
    ds = StreamingDataset(urls, seed=5, shuffle_buffer=16, decode={"text": tokenizer})
    seen = {}
    for sample in ds:
        ids = sample["text"]
        assert isinstance(ids, np.ndarray) and ids.dtype == np.int32 and ids.ndim == 1
        seen[sample["n"]] = ids.tolist()
    assert sorted(seen) == list(range(len(TEXTS)))
    for n, ids in seen.items():
        assert ids == [*py.encode(TEXTS[n]).ids, eos], n
    assert any(len(ids) > 40 for ids in seen.values())


@pytest.mark.parametrize("num_workers", [0, 2])
def test_parquet_text_and_tar_members_tokenize_alike(tmp_path, byte_level, num_workers):
    """A Parquet string column (typed text) and tar ``.txt`` members (bytes)
    give the same ids, in DataLoader worker processes too (the tokenizer is
    pickled to them)."""
    path, py = byte_level
    table = pa.table({"text": TEXTS[:30], "n": list(range(30))})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=7)
    write_tar(
        tmp_path / "t.tar",
        [m for n, t in enumerate(TEXTS[:30]) for m in ((f"{n:03d}.txt", t.encode()),)],
    )
    tokenizer = Tokenizer(str(path), bos="<|endoftext|>")
    bos = py.token_to_id("<|endoftext|>")
    for spec, field in ((str(tmp_path / "t.parquet"), "text"), (str(tmp_path / "t.tar"), "txt")):
        ds = StreamingDataset(spec, decode={field: tokenizer})
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers)
        got = {}
        for sample in loader:
            n = int(sample["n"]) if field == "text" else int(sample["__key__"])
            got[n] = np.asarray(sample[field]).tolist()
        assert got == {n: [bos, *py.encode(TEXTS[n]).ids] for n in range(30)}, spec


def test_the_post_processors_special_tokens_come_as_python_gives_them(wordpiece):
    tokenizer = Tokenizer.from_str(wordpiece.to_str())
    assert tokenizer.add_special_tokens
    cls, sep = wordpiece.token_to_id("[CLS]"), wordpiece.token_to_id("[SEP]")
    for text in TEXTS[:20]:
        ids = tokenizer.encode(text).tolist()
        assert ids == wordpiece.encode(text).ids and ids[0] == cls and ids[-1] == sep
    plain = Tokenizer.from_str(wordpiece.to_str(), add_special_tokens=False, eos=sep)
    for text in TEXTS[:20]:
        assert plain.encode(text).tolist() == [
            *wordpiece.encode(text, add_special_tokens=False).ids,
            sep,
        ]
    # The post-processor already puts [CLS] first: a bos of [CLS] would double it.
    with pytest.raises(
        ValueError, match=r"invalid Tokenizer parameter bos: .*add_special_tokens=False"
    ):
        Tokenizer.from_str(wordpiece.to_str(), bos="[CLS]")
    with pytest.raises(ValueError, match=r"invalid Tokenizer parameter eos: .*already puts"):
        Tokenizer.from_str(wordpiece.to_str(), eos=sep)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=80))
def test_any_text_gives_the_python_ids(byte_level, text):
    path, py = byte_level
    tokenizer = Tokenizer.from_str(path.read_text(encoding="utf-8"))
    assert tokenizer.encode(text).tolist() == py.encode(text).ids


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=80))
def test_any_text_gives_the_python_ids_of_a_llama_style_tokenizer(llama_style, text):
    path, py = llama_style
    tokenizer = Tokenizer.from_str(path.read_text(encoding="utf-8"))
    assert tokenizer.encode(text).tolist() == py.encode(text).ids
    for sample in TEXTS[:5]:
        ids = tokenizer.encode(sample).tolist()
        assert ids == py.encode(sample).ids
        assert ids[0] == py.token_to_id("<|begin_of_text|>")


def test_truncation_and_padding_in_the_file_are_off(byte_level):
    """A document is never cut or padded by the tokenizer: packing does that."""
    _, py = byte_level
    py = PyTokenizer.from_str(py.to_str())
    py.enable_truncation(max_length=4)
    py.enable_padding(length=128)
    tokenizer = Tokenizer.from_str(py.to_str())
    long_text = max(TEXTS, key=len)
    py.no_truncation()
    py.no_padding()
    assert tokenizer.encode(long_text).tolist() == py.encode(long_text).ids
    # Neither cut to 4 nor padded to 128.
    assert 4 < len(py.encode(long_text).ids) < 128


def test_it_pickles_by_its_text_and_compares_by_content(tmp_path, byte_level):
    path, _ = byte_level
    tokenizer = Tokenizer(path, eos=0)
    copy = pickle.loads(pickle.dumps(tokenizer))
    assert copy == tokenizer and repr(copy) == repr(tokenizer)
    assert copy.to_str() == path.read_text(encoding="utf-8")
    assert copy.eos == 0 and copy.add_special_tokens
    assert Tokenizer(path) != tokenizer
    assert repr(tokenizer).startswith("Tokenizer(digest=0x")


def test_a_tokenizer_is_read_from_a_url(tmp_path, byte_level):
    path, py = byte_level
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_bytes(path.read_bytes())
    with running_http_server(tmp_path / "tok") as server:
        tokenizer = Tokenizer(server.url("tokenizer.json"))
        assert tokenizer.encode(TEXTS[3]).tolist() == py.encode(TEXTS[3]).ids
        missing = server.url("missing.json")
        with pytest.raises(FileNotFoundError, match=f"tokenizer not found: {re.escape(missing)}"):
            Tokenizer(missing)


def test_a_state_saved_with_one_tokenizer_is_refused_by_another(tmp_path, byte_level, wordpiece):
    path, _ = byte_level
    urls = write_jsonl(tmp_path / "d", TEXTS)
    ds = StreamingDataset(urls, decode={"text": Tokenizer(path)})
    iterator = iter(ds)
    next(iterator)
    state = ds.state_dict()
    other = StreamingDataset(urls, decode={"text": Tokenizer.from_str(wordpiece.to_str())})
    other.load_state_dict(state)
    with pytest.raises(StateMismatchError, match=r"saved for other options \(decode differs\)"):
        next(iter(other))
    same = StreamingDataset(urls, decode={"text": Tokenizer(path)})
    same.load_state_dict(state)
    assert len(list(same)) == len(TEXTS) - 1


def test_text_that_is_not_utf8_is_named(tmp_path, byte_level):
    path, _ = byte_level
    write_tar(tmp_path / "bad.tar", [("a.txt", b"fine"), ("b.txt", b"caf\xe9 au lait")])
    ds = StreamingDataset(str(tmp_path / "bad.tar"), decode={"txt": Tokenizer(path)})
    with pytest.raises(
        FieldDecodeError,
        match=r'bad\.tar: cannot decode field "txt" of sample "b" as Tokenizer: '
        r"not UTF-8 text \(invalid byte at offset 3\)",
    ):
        list(ds)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda p: Tokenizer(p.parent / "none.json"),
            FileNotFoundError,
            "cannot read tokenizer .*none.json",
        ),
        (
            lambda p: Tokenizer.from_str("{}"),
            ValueError,
            "invalid tokenizer text: not a tokenizer.json",
        ),
        (lambda p: Tokenizer.from_str("[1, 2"), ValueError, "invalid tokenizer text"),
        (
            lambda p: Tokenizer(p, bos="<s>"),
            ValueError,
            'invalid Tokenizer parameter bos: "<s>" is not a token',
        ),
        (
            lambda p: Tokenizer(p, eos=400),
            ValueError,
            "invalid Tokenizer parameter eos: id 400 is not in",
        ),
        (
            lambda p: Tokenizer(p, eos=-1),
            ValueError,
            "invalid Tokenizer parameter eos: id -1 is out of range",
        ),
        (
            lambda p: Tokenizer(p, eos=1.0),
            TypeError,
            "invalid Tokenizer parameter eos: expected None, a token id",
        ),
        (
            lambda p: Tokenizer(p, add_special_tokens=1),
            TypeError,
            "add_special_tokens: expected a bool",
        ),
        (lambda p: Tokenizer(3), TypeError, "invalid Tokenizer parameter source"),
    ],
)
def test_bad_files_and_parameters_are_named(byte_level, make, error, match):
    path, _ = byte_level
    with pytest.raises(error, match=match):
        make(path)

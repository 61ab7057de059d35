"""Text data for training and evaluating Focus adapters: documents in, fixed-length token windows out.

Protocol (the same for training, evaluation and the benchmarks):

1. **Documents.** `load_documents` returns whole documents (one string per work), loaded with
   ``datasets.load_dataset("text", data_files=..., sample_by="document")`` so that each file is one
   document (the default ``sample_by="line"`` would give one row per line). With no ``source`` it
   reads the corpus shipped in ``focus_flex/corpus/``: seven public-domain 19th-century novels
   (~1.3M tokens), split **by whole book** in ``corpus/split.json`` (which also records where the
   texts come from): ``train`` = five Austen novels, ``eval`` = Austen's *Persuasion* and Dickens'
   *Great Expectations*, so evaluation text is never seen in training, not even as a neighbouring
   chapter. A local text file, directory (every ``*.txt`` below it, hidden folders skipped) or glob gives
   one document per file. Local data files (``.json``/``.jsonl``, ``.csv``/``.tsv``, ``.parquet``, ``.arrow``)
   and a folder written by ``Dataset.save_to_disk`` are datasets, as is any other string (a ``datasets``
   dataset name, loaded with ``split``): one document per row of the ``text`` column, empty rows dropped.
2. **Windows.** `token_windows` tokenizes each document on its own, with no special tokens (no BOS
   is added: SmolLM2-Instruct's BOS ``<|im_start|>`` is not a text token, and attention sinks are
   the first tokens of each window whatever they are), and cuts windows of exactly ``length`` tokens
   *inside* a document, from its start, every ``stride`` tokens (default: ``length``, i.e.
   non-overlapping); a window never spans two documents and a document's tail shorter than
   ``length`` is dropped. Windows are ordered by document, then position. ``max_windows`` keeps an
   evenly spaced subset of that list, so a small sample still covers every document, and the same
   inputs always give the same windows.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import re
from collections.abc import Iterator
from pathlib import Path

import datasets
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from focus_flex.models import max_context

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
SPLIT_FILE = CORPUS_DIR / "split.json"
DATA_FILES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet",
              ".arrow": "arrow"}  # local files read as datasets (a ``text`` column), by suffix
# Local files are read afresh every time: datasets' cache knows a file by its size and modification time, so a file
# rewritten with its old mtime (cp -p, rsync -t, tar x) would come back with its old text (reading is ~0.1 s).
FRESH = "force_redownload"


def corpus_split(split: str = "train") -> list[Path]:
    """Files of the shipped corpus that belong to ``split`` (``"train"`` or ``"eval"``)."""
    splits: dict[str, list[str]] = json.loads(SPLIT_FILE.read_text(encoding="utf-8"))["splits"]
    if split not in splits:
        raise ValueError(f"Unknown split {split!r} of the shipped corpus; choose one of {sorted(splits)}")
    return [CORPUS_DIR / name for name in splits[split]]


def load_documents(source: str | None = None, split: str = "train") -> list[str]:
    """Load whole documents as strings (see the module docstring for the protocol).

    Args:
        source: ``None`` for the shipped corpus; a local text file, a directory (all ``*.txt``
            files below it outside hidden folders, sorted) or a glob pattern (one document per file;
            ``split`` is ignored); local data files (``.json``/``.jsonl``/``.csv``/``.tsv``/``.parquet``/
            ``.arrow``: one document per row of column ``text``); a ``save_to_disk`` folder (``split``
            picks a split of a DatasetDict); or a ``datasets`` dataset name (``split`` is passed through,
            column ``text`` is used).
        split: for the shipped corpus ``"train"`` or ``"eval"``; for a dataset name, its split.

    Raises:
        FileNotFoundError: a path or glob that matches no file.
        ValueError: a file that is not UTF-8 text, an empty file, a dataset without a ``text``
            column or with no non-empty row.
        OSError: a dataset name that cannot be loaded (e.g. no Hub and not in the local cache).
    """
    if source is None:
        return _load_files(corpus_split(split))
    if not _is_path(source):
        return _load_named(source, split)
    if _saved_dataset(source):
        return _text_column(datasets.load_from_disk(os.path.expanduser(source)), source, split)
    files = _resolve_files(source)
    builders = {DATA_FILES.get(f.suffix.lower()) for f in files}
    if builders == {None}:
        return _load_files(files)
    if len(builders) > 1:
        raise ValueError(f"{source!r} mixes text files and data files ({sorted({f.suffix for f in files})}): "
                         f"pass one kind at a time")
    builder = builders.pop()
    extra = {"delimiter": "\t"} if builder == "csv" and files[0].suffix.lower() == ".tsv" else {}
    try:
        with _quiet():
            ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                       download_mode=FRESH, **extra)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        raise ValueError(f"Cannot read {source!r} as {builder} data: {e}") from e
    return _text_column(ds, source, None)


def token_windows(
    documents: list[str],
    tokenizer: PreTrainedTokenizerBase,
    length: int,
    *,
    max_windows: int | None = None,
    stride: int | None = None,
) -> torch.Tensor:
    """Cut ``[n, length]`` int64 windows of token ids, each inside a single document.

    Windows start at ``0, stride, 2*stride, ...`` of every document (``stride`` defaults to
    ``length``); with ``max_windows`` an evenly spaced, deterministic subset of all windows is kept.

    Raises:
        ValueError: bad arguments, or no document has ``length`` tokens.
    """
    stride = length if stride is None else stride
    if length < 1 or stride < 1 or (max_windows is not None and max_windows < 1):
        raise ValueError(f"length, stride and max_windows must be >= 1 (got {length}, {stride}, {max_windows})")
    ids = tokenizer(list(documents), add_special_tokens=False, verbose=False)["input_ids"] if documents else []
    starts = [(d, s) for d, doc in enumerate(ids) for s in range(0, len(doc) - length + 1, stride)]
    if not starts:
        longest = max((len(doc) for doc in ids), default=0)
        raise ValueError(
            f"No document has {length} tokens (longest: {longest} tokens in {len(ids)} documents); "
            "use a shorter window length or longer documents"
        )
    if max_windows is not None and max_windows < len(starts):
        n = len(starts)
        starts = [starts[(2 * i + 1) * n // (2 * max_windows)] for i in range(max_windows)]
    return torch.tensor([ids[d][s : s + length] for d, s in starts], dtype=torch.long)


SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+")  # the space after a sentence (passkey.SENTENCE_END: a text's end)


def repetitive_documents(documents: list[str], count: int, tokenizer: PreTrainedTokenizerBase, length: int,
                         seed: int = 0) -> list[str]:
    """``count`` documents of at least ``length`` tokens in which 1-4 consecutive sentences of one of ``documents``
    repeat, with 1-3 other sentences of that document inserted at random places among the copies.

    A passkey haystack is this kind of text: one fact among many copies of the same sentences, which the lower
    layers of full attention read over its whole length and novels never show (docs/passkey.md, point 39). The
    sentences are the training text's own, so neither the evaluation's filler nor its needle is trained on.
    Document ``d`` is built from ``documents[d % len(documents)]``; the same arguments give the same documents.

    Raises:
        ValueError: ``count`` < 0, or a document with fewer than 8 sentences of 20-200 characters.
    """
    if count < 0 or (count and not documents):
        raise ValueError(f"count={count} repetitive documents from {len(documents)} documents: count must be >= 0, "
                         f"and > 0 only with at least one document")
    rng = random.Random(seed)
    pools = []
    for i, doc in enumerate(documents[:count]):
        pool = [s for s in (t.strip() for t in SENTENCE_BREAK.split(" ".join(doc.split()))) if 20 <= len(s) <= 200]
        if len(pool) < 8:
            raise ValueError(f"training document {i} has {len(pool)} sentences of 20-200 characters; repetitive "
                             f"documents are built from documents of at least 8 such sentences")
        pools.append(pool)
    out = []
    for d in range(count):
        pool = pools[d % len(pools)]
        start = rng.randrange(len(pool) - 4)
        block = " ".join(pool[start:start + rng.randint(1, 4)])
        per_copy = len(tokenizer(" " + block, add_special_tokens=False)["input_ids"])  # as it follows a copy
        body = [block] * (length // per_copy + 2)
        for _ in range(rng.randint(1, 3)):
            body.insert(rng.randrange(len(body) + 1), rng.choice(pool))
        out.append(" ".join(body))
    return out


def _is_path(source: str) -> bool:
    """A local path or glob, as opposed to a ``datasets`` name such as ``"user/name"``."""
    expanded = os.path.expanduser(source)
    return (
        os.path.exists(expanded)
        or glob.has_magic(source)
        or source.startswith((".", "/", "~", os.sep))
        or source.count("/") > 1
        or Path(source).suffix.lower() in {".txt", ".text", ".md"}
    )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No ``datasets`` progress bars while local files are read (a fraction of a second, at every load)."""
    was = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was:
            datasets.enable_progress_bars()


def _saved_dataset(source: str) -> bool:
    """Whether ``source`` is a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    path = Path(os.path.expanduser(source))
    return path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file())


def _resolve_files(source: str) -> list[Path]:
    path = Path(os.path.expanduser(source))
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt")  # not in hidden folders (.git, .ipynb_checkpoints, ...)
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise FileNotFoundError(f"Directory {source!r} contains no *.txt files")
        return files
    if glob.has_magic(source):
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if os.path.isfile(p))
        if not files:
            raise FileNotFoundError(f"Pattern {source!r} matches no file")
        return files
    raise FileNotFoundError(
        f"No such file or directory: {source!r} (pass a text file, a directory of *.txt files, "
        "a glob pattern, a datasets name, or None for the shipped corpus)"
    )


def _load_files(files: list[Path]) -> list[str]:
    unreadable = [str(f) for f in files if not os.access(f, os.R_OK)]
    if unreadable:
        raise PermissionError(f"Cannot read {unreadable}")
    try:
        with _quiet():
            ds = datasets.load_dataset("text", data_files=[str(f) for f in files], sample_by="document",
                                       split="train", download_mode=FRESH)
    except datasets.exceptions.DatasetGenerationError as e:
        raise ValueError(f"Cannot read the text files: {_first_bad_file(files) or e}") from e
    docs: list[str] = [d.removeprefix("\ufeff") for d in ds["text"]]  # a UTF-8 byte-order mark is not text
    if len(docs) != len(files):
        raise ValueError(f"Expected one document per file, got {len(docs)} from {len(files)} files")
    empty = [str(f) for f, doc in zip(files, docs, strict=True) if not doc.strip()]
    if empty:
        raise ValueError(f"Empty document(s): {empty}")
    return docs


def _first_bad_file(files: list[Path]) -> str | None:
    for f in files:
        try:
            f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            return f"{f} is not UTF-8 text ({e})"
    return None


def _load_named(name: str, split: str) -> list[str]:
    try:
        ds = datasets.load_dataset(name, split=split)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        raise OSError(
            f"{name!r} is neither a local file/directory nor a loadable datasets dataset "
            f"(split {split!r}): {e}. With no Hub reachable, pass local text files, "
            "or None for the shipped corpus."
        ) from e
    return _text_column(ds, name, split)


def _text_column(ds: datasets.Dataset | datasets.DatasetDict, name: str, split: str | None) -> list[str]:
    """The non-empty rows of the ``text`` column of ``ds`` (for a DatasetDict, of its ``split``)."""
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"Dataset {name!r} has splits {sorted(ds)}, not {split!r}: choose one")
        ds = ds[split]
    if "text" not in ds.column_names:
        raise ValueError(f"Dataset {name!r} has no 'text' column; its columns are {ds.column_names}")
    docs = [doc for doc in ds["text"] if isinstance(doc, str) and doc.strip()]
    if not docs:
        where = f" (split {split!r})" if split else ""
        raise ValueError(f"Dataset {name!r}{where} has no non-empty 'text' row")
    return docs


def check_windows(windows: torch.Tensor, model: PreTrainedModel, name: str = "windows") -> torch.Tensor:
    """``windows`` as int64 ``[N, L]`` token ids, N >= 1, 2 <= L <= the model's context (else a clear error)."""
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.shape[0] < 1 or windows.shape[1] < 2:
        shape = tuple(windows.shape) if isinstance(windows, torch.Tensor) else type(windows).__name__
        raise ValueError(f"{name} must be a non-empty [N, L] tensor of token ids with L >= 2, got {shape}")
    if windows.is_floating_point() or windows.is_complex() or windows.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got {windows.dtype}")
    limit = max_context(model)
    if windows.shape[1] > limit:
        raise ValueError(f"{name} have {windows.shape[1]} tokens, more than the model's context of {limit} "
                         "(max_position_embeddings): use shorter windows")
    return windows.long()

"""Evaluation and calibration text, prepared exactly as the GPTQ family prepares it.

WikiText-2 (`wikitext2`)
    GPTQ: ``"\\n\\n".join(load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"])``.
    The Hugging Face items are the lines of the raw split file: a non-blank line keeps its
    trailing "\\n", a blank (whitespace-only) line becomes "". A local file (`data_path`) is
    turned into the same items (lines read in text mode, trailing newline kept, blank lines
    -> "") and joined with "\\n\\n", so the raw release file gives the `datasets` text byte
    for byte.
C4 (`c4`, GPTQ's "c4-new")
    The first 1100 documents of allenai/c4 ``en/c4-validation.00000-of-00008.json.gz``
    (split "train": of ``en/c4-train.00000-of-01024.json.gz``), joined with " "; evaluation keeps the first 256 x seqlen tokens (256 windows). A local
    file is JSON lines with a "text" field (``.json``, ``.jsonl``, optionally ``.gz``) or
    plain text with one document per line; its first 1100 documents are used.

Sources, in order: a local file (`data_path`); the `datasets` library (the `datasets` extra,
``pip install -e '.[datasets]'``: the core install reads local files only);
`tensorflow-datasets` (``pip install -e '.[datasets,tfds]'``). TFDS serves WikiText-2 only through its ``huggingface:`` community
namespace, which itself runs `datasets`; its native ``c4/en`` validation split holds the same
corpus in a different document order, so its first 1100 documents are not GPTQ's and its
perplexities are not comparable with the papers' C4 figures.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import numpy as np

from cmoe_jax.errors import CmoeError

DATASETS = ("wikitext2", "c4")
SOURCES = ("auto", "file", "datasets", "tfds")
C4_DOCUMENTS = 1100
C4_WINDOWS = 256
C4_SHARDS = {"validation": "en/c4-validation.00000-of-00008.json.gz",
             "train": "en/c4-train.00000-of-01024.json.gz"}
TFDS_NAMES = {"wikitext2": "huggingface:wikitext/wikitext-2-raw-v1", "c4": "c4/en"}
# tfds serves WikiText-2 only through its huggingface: bridge, which runs `datasets`
_INSTALL = {("datasets", "wikitext2"): "pip install -e '.[datasets]'",
            ("datasets", "c4"): "pip install -e '.[datasets]'",
            ("tfds", "wikitext2"): "pip install -e '.[datasets,tfds]'",
            ("tfds", "c4"): "pip install -e '.[tfds]'"}
_LIBRARIES = {"datasets": ("datasets", "the `datasets` library"),
              "tfds": ("tensorflow_datasets", "tensorflow-datasets")}


class DataError(CmoeError, ValueError):
    """Missing, unreadable or too-short evaluation / calibration data."""


def default_split(dataset: str) -> str:
    """The evaluation split of each dataset (GPTQ: WikiText-2 test, C4 validation)."""
    return "test" if dataset == "wikitext2" else "validation"


def _hf_split(split: str) -> str:
    return {"valid": "validation", "val": "validation"}.get(split, split)


def _check_file(path: Path) -> None:
    if not path.exists():
        raise DataError(f"data file {path} does not exist")
    if not path.is_file():
        raise DataError(f"data path {path} is not a file (give the text file itself)")


# control characters that are not whitespace (NUL, escape, DEL, C1 controls): a text holds few
_CONTROL = dict.fromkeys([c for c in (*range(0x20), *range(0x7f, 0xa0)) if not chr(c).isspace()])
_CONTROL_OR_SPACE = dict.fromkeys([*_CONTROL, *(c for c in range(0x3001) if chr(c).isspace())])
CONTROL_SHARE = 0.1  # more than this share of a text's visible characters: not a text


def check_text(path: Path, items: list[str]) -> list[str]:
    """`items` of the local file `path`, refused (one line) when they hold no printable text or
    mostly control characters (a binary file, a file of NUL bytes): the perplexity of such a
    "text" is a number about nothing."""
    text = "".join(items)
    visible = len(text.translate(_CONTROL_OR_SPACE))
    control = len(text) - len(text.translate(_CONTROL))
    if not visible:
        raise DataError(f"data file {path} holds no printable text{' (only control characters)' if control else ''}: "
                        "give a text file")
    if control > CONTROL_SHARE * (visible + control):
        raise DataError(f"data file {path} is not text: {control} of its {visible + control} visible "
                        "characters are control characters (NUL and the like); give a text file")
    return items


def wikitext_items_from_file(path: Path) -> list[str]:
    """The `datasets` items of a WikiText release file: lines with their "\\n", blank -> ""
    (a UTF-8 byte order mark at the start is not text, and is dropped)."""
    path = Path(path)
    _check_file(path)
    try:
        with open(path, encoding="utf-8-sig") as f:
            return check_text(path, [line if line.strip() else "" for line in f])
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def c4_documents_from_file(path: Path, limit: int = C4_DOCUMENTS) -> list[str]:
    """The first `limit` documents of a C4 JSON-lines file (optionally .gz) or a text file."""
    path = Path(path)
    _check_file(path)
    opener = gzip.open if path.suffix == ".gz" else open
    is_json = ".json" in "".join(path.suffixes)
    docs: list[str] = []
    try:
        with opener(path, "rt", encoding="utf-8-sig") as f:  # a byte order mark is dropped
            for lineno, line in enumerate(f, 1):
                if len(docs) == limit:
                    break
                if is_json:
                    if not line.strip():
                        continue
                    try:
                        docs.append(json.loads(line)["text"])
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise DataError(f"{path} line {lineno} is not a JSON object with a "
                                        "\"text\" field (C4 JSON lines expected)") from None
                else:
                    docs.append(line.rstrip("\n"))
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (gzip.BadGzipFile, EOFError) as e:
        raise DataError(f"data file {path} is not a valid gzip file ({e})") from None
    return check_text(path, docs)


def _from_datasets(dataset: str, split: str) -> list[str]:
    import datasets  # ImportError handled by the caller

    try:
        if dataset == "wikitext2":
            return list(datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split=_hf_split(split))["text"])
        split = _hf_split(split)
        if split not in C4_SHARDS:
            raise DataError(f"C4 split {split!r} is not available: choose one of {', '.join(C4_SHARDS)}")
        docs = datasets.load_dataset("allenai/c4", data_files={split: C4_SHARDS[split]}, split=split)
        return list(docs.select(range(min(C4_DOCUMENTS, len(docs))))["text"])
    except DataError:
        raise
    except Exception as e:  # network, Hub or cache failures: one clear line
        raise DataError(f"could not load {dataset} ({split}) with `datasets` "
                        f"({type(e).__name__}: {str(e)[:200]}); give a local file with --data-path") from e


def _from_tfds(dataset: str, split: str) -> list[str]:
    import tensorflow_datasets as tfds  # ImportError handled by the caller

    try:
        ds = tfds.load(TFDS_NAMES[dataset], split=_hf_split(split))
        if dataset == "c4":
            ds = ds.take(C4_DOCUMENTS)
        return [ex["text"].decode("utf-8") for ex in tfds.as_numpy(ds)]
    except Exception as e:
        raise DataError(f"could not load {dataset} ({split}) with tensorflow-datasets "
                        f"({type(e).__name__}: {str(e)[:200]}); give a local file with --data-path") from e


def load_items(dataset: str, split: str | None = None, data_path: str | None = None,
               source: str = "auto") -> list[str]:
    """The dataset's items (WikiText-2 lines or C4 documents) before joining."""
    if dataset not in DATASETS:
        raise DataError(f"unknown dataset {dataset!r}: choose one of {', '.join(DATASETS)}")
    if source not in SOURCES:
        raise DataError(f"unknown data source {source!r}: choose one of {', '.join(SOURCES)}")
    split = split or default_split(dataset)
    if data_path is not None:
        if source not in ("auto", "file"):
            raise DataError(f"a data path was given with source {source!r}: use one or the other")
        path = Path(data_path).expanduser()
        return wikitext_items_from_file(path) if dataset == "wikitext2" else c4_documents_from_file(path)
    if source == "file":
        raise DataError(f"source 'file' needs a data path (--data-path FILE) for {dataset}")
    loaders = {"datasets": _from_datasets, "tfds": _from_tfds}
    for name in (["datasets", "tfds"] if source == "auto" else [source]):
        try:
            return loaders[name](dataset, split)
        except ImportError:
            continue
    raise _no_download_library(dataset, source)


def _no_download_library(dataset: str, source: str) -> DataError:
    """The one-line error of a download without its library: the extra to install (for
    `auto`, the `datasets` one), or a local file."""
    name = "datasets" if source == "auto" else source
    return DataError(f"{dataset} without --data-path is downloaded with {_LIBRARIES[name][1]}, which is "
                     f"not installed: {_INSTALL[name, dataset]} (in the checkout), or give a local "
                     "file with --data-path FILE")


def check_download(dataset: str, source: str = "auto") -> None:
    """Before any work: the error `load_items` would give when `dataset` is to be downloaded
    (no local file) and no library for `source` is installed. Imports nothing."""
    if source not in ("auto", *_LIBRARIES):
        return  # `load_items` names what is wrong with the dataset or source
    names = ["datasets", "tfds"] if source == "auto" else [source]
    if not any(importlib.util.find_spec(_LIBRARIES[n][0]) for n in names):
        raise _no_download_library(dataset, source)


def join_items(dataset: str, items: list[str]) -> str:
    """GPTQ's joining: "\\n\\n" between WikiText-2 lines, " " between C4 documents."""
    return "\n\n".join(items) if dataset == "wikitext2" else " ".join(items)


def load_text(dataset: str, split: str | None = None, data_path: str | None = None,
              source: str = "auto") -> str:
    """The dataset's evaluation/calibration text, joined by the GPTQ convention."""
    return join_items(dataset, load_items(dataset, split, data_path, source))


def load_text_tokens(dataset: str, tokenizer, split: str | None = None, data_path: str | None = None,
                     source: str = "auto") -> np.ndarray:
    """Token ids (int32 numpy, no special tokens added) of the dataset text."""
    text = load_text(dataset, split, data_path, source)
    return np.asarray(tokenizer.encode(text), dtype=np.int32)

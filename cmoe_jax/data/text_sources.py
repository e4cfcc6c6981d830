"""Evaluation and calibration text, as the GPTQ family prepares it.

- WikiText-2: the split's lines joined with "\\n\\n" (GPTQ: "\\n\\n".join(data["text"])).
- C4 ("c4-new"): the first 1100 documents of the en validation shard, joined with " ";
  evaluation keeps the first 256 windows.
Sources: `datasets` (Hugging Face), `tensorflow-datasets`, or a local file (`data_path`).
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from cmoe_jax.errors import CmoeError

DATASETS = ("wikitext2", "c4")
C4_DOCUMENTS = 1100
C4_WINDOWS = 256
_C4_SHARD = "en/c4-validation.00000-of-00008.json.gz"
TFDS_NAMES = {"wikitext2": "huggingface:wikitext/wikitext-2-raw-v1", "c4": "c4/en"}


class DataError(CmoeError):
    """Missing or too-short evaluation / calibration data."""


def _wikitext_lines_from_file(path: Path) -> list[str]:
    # The local release stores one paragraph per line; joining the lines with "\n\n"
    # mirrors "\n\n".join(dataset["text"]) of the `datasets` path.
    return path.read_text(encoding="utf-8").splitlines()


def _c4_documents_from_file(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        if ".json" in path.name:
            return [json.loads(line)["text"] for _, line in zip(range(C4_DOCUMENTS), f)]
        return [line.rstrip("\n") for _, line in zip(range(C4_DOCUMENTS), f)]


def _hf_split(split: str) -> str:
    return {"valid": "validation", "val": "validation"}.get(split, split)


def _from_datasets(dataset: str, split: str) -> list[str]:
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        if dataset == "wikitext2":
            return list(datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split=_hf_split(split))["text"])
        docs = datasets.load_dataset("allenai/c4", data_files={"validation": _C4_SHARD}, split="validation")
        return list(docs.select(range(C4_DOCUMENTS))["text"])
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise DataError(f"no local --data-path given and neither `datasets` nor "
                        f"`tensorflow-datasets` is installed: pip install 'cmoe_jax[datasets]' "
                        f"(or give --data-path FILE for {dataset})") from None
    # TFDS has C4 natively; WikiText-2 comes through its Hugging Face community bridge.
    name = TFDS_NAMES[dataset]
    ds = tfds.load(name, split=_hf_split(split) if dataset == "wikitext2" else "validation")
    return [ex["text"].numpy().decode("utf-8") for ex in ds.take(C4_DOCUMENTS if dataset == "c4" else -1)]


def load_text(dataset: str, split: str = "test", data_path: str | None = None) -> str:
    """The dataset's evaluation/calibration text, joined by the GPTQ convention."""
    if dataset not in DATASETS:
        raise DataError(f"unknown dataset {dataset!r}: choose one of {', '.join(DATASETS)}")
    if data_path is not None:
        path = Path(data_path)
        if not path.exists():
            raise DataError(f"data file {path} does not exist")
        items = _wikitext_lines_from_file(path) if dataset == "wikitext2" else _c4_documents_from_file(path)
    else:
        items = _from_datasets(dataset, split)
    return "\n\n".join(items) if dataset == "wikitext2" else " ".join(items)


def load_text_tokens(dataset: str, tokenizer, split: str = "test", data_path: str | None = None):
    """Token ids (int32 numpy) of the dataset text."""
    import numpy as np

    return np.asarray(tokenizer.encode(load_text(dataset, split, data_path)), dtype=np.int32)

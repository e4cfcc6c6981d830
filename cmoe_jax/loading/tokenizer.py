"""Tokenizers for checkpoints: `tokenizer.json` of a Hugging Face directory, or the GGUF vocab."""
from __future__ import annotations

from pathlib import Path


class Tokenizer:
    """Thin wrapper: `encode(text)` returns ids without special tokens (perplexity convention)."""

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer

    def encode(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids) -> str:
        return self.hf.decode(ids)


def load_tokenizer(path: Path) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships none (weights-only directories)."""
    import transformers

    transformers.logging.set_verbosity_error()
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        import gguf

        if "tokenizer.ggml.model" not in gguf.GGUFReader(str(path)).fields:
            return None
        return Tokenizer(transformers.AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name))
    if any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return Tokenizer(transformers.AutoTokenizer.from_pretrained(str(path)))
    return None

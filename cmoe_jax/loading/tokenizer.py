"""Tokenizers for checkpoints: `tokenizer.json` of a Hugging Face directory, or the GGUF vocab.

A GGUF file's tokenizer is rebuilt from the file's own metadata without torch:
`transformers.AutoTokenizer(gguf_file=...)` reads that metadata through a reader that
imports torch, so the metadata is read here with the `gguf` package and handed to
transformers' torch-free GGUF tokenizer builders (byte-level BPE, SentencePiece BPE,
unigram; the pre-tokenizer `tokenizer.ggml.pre` names; control tokens kept whole). The
result gives the same ids as `AutoTokenizer(gguf_file=...)` (tests/test_tokenizer.py).
"""
from __future__ import annotations

from pathlib import Path

from cmoe_jax.errors import CheckpointError
from cmoe_jax.loading.gguf_reader import FastGGUFReader


class Tokenizer:
    """Thin wrapper: `encode(text)` returns ids without special tokens (perplexity convention)."""

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer

    def encode(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids) -> str:
        return self.hf.decode(ids)


def window_bos(cfg, tokenizer: Tokenizer | None) -> int | None:
    """The BOS id that opens every evaluation window of a model (its `ModelConfig`), or None.

    Per family, as lm-eval's `add_bos_token` (on for Gemma, off for the others): a family
    whose unit sets `bos_per_window` reads each window as a document of its own, which is
    what it was trained on; SmolLM2, Llama and Qwen windows stay plain text."""
    if tokenizer is None or not cfg.family.bos_per_window:
        return None
    return tokenizer.hf.bos_token_id


def gguf_tokenizer_metadata(reader) -> tuple[str, dict, dict]:
    """`(architecture, tokenizer_dict, tokenizer_config)` as transformers' GGUF reader gives them."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS, GGUF_TOKENIZER_MAPPING)

    def field(key):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    grouped = {group: {name: field(f"tokenizer.{key}") for key, name in renames.items()
                       if f"tokenizer.{key}" in reader.fields}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp's default for SentencePiece vocabs
    elif tokenizer.get("tokenizer_type") == "gemma4":
        config["add_bos_token"] = False
    for name, key in _SPECIAL_TOKENS.items():
        token_id = field(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return field("general.architecture"), tokenizer, config


def gguf_tokenizer(path: Path, reader=None) -> Tokenizer | None:
    """The tokenizer a GGUF file describes, or None when the file carries no vocabulary."""
    import transformers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    transformers.logging.set_verbosity_error()
    if reader is None:
        try:
            reader = FastGGUFReader(str(path))
        except Exception as e:
            raise CheckpointError(f"{path} is not a readable GGUF file ({e})") from e
    if "tokenizer.ggml.model" not in reader.fields:
        return None
    try:
        architecture, tokenizer_dict, config = gguf_tokenizer_metadata(reader)
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e
    except (KeyError, IndexError, TypeError, AttributeError) as e:  # a field missing or of another type
        raise CheckpointError(f"{path}: its tokenizer metadata (tokenizer.ggml.*) is incomplete or "
                              f"damaged ({type(e).__name__}: {e}): re-convert or re-download the file") from None
    return Tokenizer(TokenizersBackend(tokenizer_object=backend, **config, **extra))


def load_tokenizer(path: Path, gguf_reader=None) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships none (weights-only directories).
    A converted cmoe_jax model keeps its tokenizer in `tokenizer/`."""
    path = Path(path)
    if path.is_dir() and (path / "tokenizer").is_dir():
        path = path / "tokenizer"
    if path.is_file() and path.suffix == ".gguf":
        return gguf_tokenizer(path, gguf_reader)
    if any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        import transformers

        transformers.logging.set_verbosity_error()
        try:  # never the remote code an exported carved model ships for its layers: a tokenizer needs none
            return Tokenizer(transformers.AutoTokenizer.from_pretrained(str(path), trust_remote_code=False))
        except Exception as e:  # transformers' own checks of the files, of its own error types
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise CheckpointError(f"cannot read the tokenizer in {path} ({type(e).__name__}: {first}): its "
                                  "files or config.json are damaged; re-download the model") from None
    return None

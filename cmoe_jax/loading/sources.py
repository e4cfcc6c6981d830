"""Read checkpoint tensors one at a time, under their Hugging Face names, as numpy arrays.

Every source presents the `transformers` naming and layout ([out, in] for projections), so
a single name map (`hf_names.py`) serves safetensors, PyTorch `.bin` and GGUF alike.
"""
from __future__ import annotations

import abc
import json
import mmap
import os
from pathlib import Path
from typing import Iterable

import ml_dtypes
import numpy as np
from safetensors import safe_open

from cmoe_jax.errors import CheckpointError, UnsupportedModelError, require
from cmoe_jax.loading.gguf_dequant import dequantize
from cmoe_jax.loading.gguf_reader import FastGGUFReader
from cmoe_jax.models.families import by_gguf_arch


class TensorSource(abc.ABC):
    """A read-only mapping name -> numpy array that loads lazily."""

    @abc.abstractmethod
    def names(self) -> Iterable[str]:
        """Every tensor name the source holds."""

    @abc.abstractmethod
    def get(self, name: str) -> np.ndarray:
        """The tensor `name`, read now."""

    def __contains__(self, name: str) -> bool:
        return name in set(self.names())

    def release(self) -> None:
        """Drop the file pages read so far from this process's memory. A memory-mapped file
        keeps every page it touched resident in the reader's address space; a streamed job
        calls this after each layer so its footprint stays one layer, not the whole file."""


def index_files(directory: Path, index: Path) -> list[str]:
    """The shard files an index's `weight_map` names, each confined to `directory` (an
    absolute path or one climbing out with `..` is refused, not read)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index} is not a valid index (no weight_map of file names: {e}): "
                              "re-download the model") from None
    root = directory.resolve()
    for f in files:
        if not isinstance(f, str) or Path(f).is_absolute() or not (root / f).resolve().is_relative_to(root):
            raise CheckpointError(f"{index} names the shard {f!r} outside the model directory: "
                                  "an index may only name files inside it; fix or re-download the model")
    return files


class _InMemoryIndex(TensorSource):
    """A source whose `_tensors` dict maps every name to a lazily read handle."""

    _tensors: dict

    def names(self):
        return self._tensors.keys()

    def __contains__(self, name):
        return name in self._tensors


class SafetensorsSource(TensorSource):
    """`model.safetensors`, or shards listed in `model.safetensors.index.json`."""

    def __init__(self, directory: Path):
        index = directory / "model.safetensors.index.json"
        if index.exists():
            files = index_files(directory, index)
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = ["model.safetensors"]
            weight_map = None
        self._directory, self._files = directory, files
        self.release()
        if weight_map is None:
            weight_map = {n: files[0] for n in self._handles[files[0]].keys()}
        self._where = weight_map

    def release(self):
        """(Re)open every shard: closing a `safe_open` handle unmaps its file."""

        self._handles = {}
        for f in self._files:
            path = self._directory / f
            if not path.exists():
                raise CheckpointError(f"checkpoint shard {path} is missing: re-download the model")
            try:
                self._handles[f] = safe_open(str(path), framework="np")
            except Exception as e:  # safetensors raises its own error type for bad headers
                raise CheckpointError(
                    f"{path} is corrupted or truncated ({e}): re-download the model") from e

    def names(self):
        return self._where.keys()

    def __contains__(self, name):
        return name in self._where

    def get(self, name):
        f = self._where[name]
        try:
            return self._handles[f].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {f} ({e}): the file is "
                                  "corrupted or truncated; re-download the model") from e


class TorchBinSource(_InMemoryIndex):
    """`pytorch_model.bin` (and its sharded index), memory-mapped so tensors load one by one."""

    def __init__(self, directory: Path):
        torch = require("torch", "torch", "reading pytorch_model.bin")
        index = directory / "pytorch_model.bin.index.json"
        files = index_files(directory, index) if index.exists() else ["pytorch_model.bin"]
        self._tensors = {}
        for f in files:
            try:
                sd = torch.load(directory / f, map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:
                raise CheckpointError(f"{directory / f} is corrupted or truncated ({e}): "
                                      "re-download the model") from e
            self._tensors.update(sd)

    def get(self, name):
        import torch

        t = self._tensors[name]
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()


_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                      "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


class GGUFSource(_InMemoryIndex):
    """A GGUF file, dequantised (`gguf_dequant`) and renamed to `transformers` names.

    The family unit (`cmoe_jax.models.families`) of the file's architecture names its
    tensors and says what llama.cpp changed: the rows of Q and K permuted for its interleaved
    RoPE (llama; undone here so the weights match the rotate-half RoPE), norm weights stored
    shifted (Gemma's `1 + w`; shifted back).
    """

    def __init__(self, path: Path):
        try:
            self.reader = FastGGUFReader(str(path))
        except Exception as e:
            raise CheckpointError(f"{path} is not a readable GGUF file ({e})") from e
        self.path = Path(path)
        self.arch = self.field("general.architecture")
        self.family = by_gguf_arch(self.arch, experts=bool(self.field(f"{self.arch}.expert_count")))
        self._tensors = {}
        self._rope_freqs = None
        for t in self.reader.tensors:
            hf = self._hf_name(t.name)
            if hf is not None:
                self._tensors[hf] = t
            elif t.name == "rope_freqs.weight":
                self._rope_freqs = t

    def release(self):
        """Advise the kernel that the mapped file's pages are not needed now (they are read
        back from the page cache or disk when touched again)."""

        mapped = getattr(self.reader.data, "_mmap", None)
        if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED)

    def field(self, key, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def _hf_name(self, name: str) -> str | None:
        if name in _GGUF_GLOBAL_NAMES:
            return _GGUF_GLOBAL_NAMES[name]
        parts, layer_names = name.split("."), self.family.gguf_layer
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
            return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
        return None

    def hf_config(self) -> dict:
        a = self.arch
        heads = self.field(f"{a}.attention.head_count")
        cfg = {
            "model_type": self.family.model_type,
            "vocab_size": self.field(f"{a}.vocab_size") or len(self.field("tokenizer.ggml.tokens")),
            "hidden_size": self.field(f"{a}.embedding_length"),
            "intermediate_size": self.field(f"{a}.feed_forward_length"),
            "num_hidden_layers": self.field(f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self.field(f"{a}.attention.head_count_kv", heads),
            "rms_norm_eps": self.field(f"{a}.attention.layer_norm_rms_epsilon"),
            "rope_theta": self.field(f"{a}.rope.freq_base", 10000.0),
            "max_position_embeddings": self.field(f"{a}.context_length"),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
        }
        key_len = self.field(f"{a}.attention.key_length")
        if key_len:
            cfg["head_dim"] = key_len
        scaling = self.rope_scaling()
        if scaling:
            cfg["rope_scaling"] = scaling
        if self.field(f"{a}.expert_count"):  # layers without a router keep a dense FFN
            cfg["mlp_only_layers"] = [i for i in range(cfg["num_hidden_layers"])
                                      if f"model.layers.{i}.mlp.gate.weight" not in self._tensors]
        cfg.update(self.family.gguf_config(self.field))
        return cfg

    def rope_scaling(self) -> dict | None:
        """RoPE scaling as llama.cpp stores it, in the form `ModelConfig` reads.

        Llama-3-style scaling is written by llama.cpp's converter as a `rope_freqs` tensor (one
        divisor per frequency); linear scaling as `rope.scaling.type = linear` and its factor.
        Both become per-frequency divisors ("freq_factors"), which is exactly how llama.cpp
        applies them, so any mix of the two is reproduced.
        """

        a = self.arch
        kind = self.field(f"{a}.rope.scaling.type")
        if kind not in (None, "none", "linear"):
            raise UnsupportedModelError(f"{self.path}: GGUF RoPE scaling {kind!r} is not supported "
                                        "(supported: linear, and Llama-3 rope_freqs factors)")
        linear = float(self.field(f"{a}.rope.scaling.factor", 1.0) or 1.0) if kind == "linear" else 1.0
        if self._rope_freqs is None:
            return {"rope_type": "linear", "factor": linear} if kind == "linear" else None
        t = self._rope_freqs
        factors = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1) * linear
        return {"rope_type": "freq_factors", "factors": tuple(float(f) for f in factors)}

    def get(self, name):
        t = self._tensors[name]
        w = dequantize(t.data, t.tensor_type).reshape(tuple(int(s) for s in reversed(t.shape)))
        if self.family.gguf_norm_shift and name.endswith("norm.weight"):
            w = w - np.float32(self.family.gguf_norm_shift)
        if self.family.gguf_permute_qk and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight")):
            a = self.arch
            n_head = self.field(f"{a}.attention.head_count")
            if name.endswith("k_proj.weight"):
                n_head = self.field(f"{a}.attention.head_count_kv", n_head)
            # inverse of llama.cpp's permute(): rows (head, half, 2) -> (head, 2, half)
            w = w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            w = w.swapaxes(1, 2).reshape(-1, *w.shape[3:])
        return w


def open_source(path: Path) -> TensorSource:
    """Pick the reader for a checkpoint file or directory."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return GGUFSource(path)
    if path.is_dir():
        if (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists():
            return SafetensorsSource(path)
        if (path / "pytorch_model.bin").exists() or (path / "pytorch_model.bin.index.json").exists():
            return TorchBinSource(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return GGUFSource(ggufs[0])
    raise CheckpointError(
        f"no weights found at {os.fspath(path)}: expected model.safetensors (or a sharded "
        "index), pytorch_model.bin, or a .gguf file")

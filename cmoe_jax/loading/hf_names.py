"""Where each parameter of `cmoe_jax.models.Decoder` comes from in a Hugging Face checkpoint.

`fetch(source, path)` returns the numpy array for one parameter path, already in JAX layout
([in, out] projections, experts stacked on a leading axis).
"""
from __future__ import annotations

import numpy as np

from cmoe_jax.errors import CheckpointError
from cmoe_jax.loading.sources import TensorSource
from cmoe_jax.models.families import family
from cmoe_jax.models.families.base import ATTENTION as _ATTN, DENSE_MLP as _DENSE_MLP
from cmoe_jax.models.families.base import SHARED_EXPERT as _SHARED_EXPERT
# Per-expert tensor names: Qwen3-MoE style, then Mixtral's w1/w3/w2.
_EXPERT_NAMES = {"expert_gate": ("gate_proj", "w1"), "expert_up": ("up_proj", "w3"),
                 "expert_down": ("down_proj", "w2")}
_MOE_PREFIXES = ("mlp", "block_sparse_moe")


def _get(source: TensorSource, name: str) -> np.ndarray:
    if name not in source:
        raise CheckpointError(f"tensor {name!r} is missing from the checkpoint: the config does "
                              "not match the weights, or the file is incomplete")
    return source.get(name)


def _first_present(source: TensorSource, names: list[str]) -> str | None:
    return next((n for n in names if n in source), None)


def _experts(source: TensorSource, layer: int, kind: str, num_experts: int) -> np.ndarray:
    base = f"model.layers.{layer}"
    # experts stacked [E, out, in]: transformers 5 in memory (gate and up fused as
    # gate_up_proj [E, 2m, d], down_proj [E, d, m]) or llama.cpp's GGUF (`*.weight`, unfused)
    for pre in _MOE_PREFIXES:
        for stacked in (f"{base}.{pre}.experts.{_EXPERT_NAMES[kind][0]}{s}" for s in ("", ".weight")):
            if stacked in source:
                return np.ascontiguousarray(np.swapaxes(source.get(stacked), 1, 2))
        fused = f"{base}.{pre}.experts.gate_up_proj"
        if kind != "expert_down" and fused in source:
            w = source.get(fused)
            half = w.shape[1] // 2
            w = w[:, :half] if kind == "expert_gate" else w[:, half:]
            return np.ascontiguousarray(np.swapaxes(w, 1, 2))
    stacked = []
    for e in range(num_experts):
        candidates = [f"{base}.{pre}.experts.{e}.{n}.weight"
                      for pre in _MOE_PREFIXES for n in _EXPERT_NAMES[kind]]
        name = _first_present(source, candidates)
        if name is None:
            raise CheckpointError(f"tensor {candidates[0]!r} is missing from the checkpoint: "
                                  "the config does not match the weights")
        stacked.append(source.get(name).T)
    return np.stack(stacked)


def fetch(source: TensorSource, path: tuple, model_type: str) -> tuple[str, np.ndarray]:
    """(checkpoint name, array in JAX layout) for one Decoder parameter path of a
    `model_type` checkpoint (its family unit names the norms)."""
    if path == ("embed",):
        name = "model.embed_tokens.weight"
        return name, _get(source, name)
    if path == ("lm_head",):
        name = "lm_head.weight"
        return name, _get(source, name).T
    if path == ("norm", "weight"):
        name = "model.norm.weight"
        return name, _get(source, name)
    if path[0] != "layers":
        raise CheckpointError(f"no checkpoint tensor known for parameter {'/'.join(map(str, path))}")
    layer, module, leaf = path[1], path[2], path[3:]
    base = f"model.layers.{layer}"
    norms = family(model_type).norms
    if module in norms:
        name = f"{base}.{norms[module]}.weight"
        return name, _get(source, name)
    if module == "attn":
        if leaf[0] in ("q_norm", "k_norm"):
            name = f"{base}.self_attn.{leaf[0]}.weight"
            return name, _get(source, name)
        name = f"{base}.self_attn.{_ATTN[leaf[0]]}"
        w = _get(source, name)
        return name, (w.T if w.ndim == 2 else w)
    if module == "mlp":
        if leaf[0] in _DENSE_MLP:
            name = f"{base}.mlp.{_DENSE_MLP[leaf[0]]}.weight"
            return name, _get(source, name).T
        if leaf[0] in _SHARED_EXPERT:  # Qwen2-MoE's shared expert and its sigmoid gate
            name = f"{base}.mlp.{_SHARED_EXPERT[leaf[0]]}.weight"
            return name, np.atleast_2d(_get(source, name)).T  # the gate: [1, d], or [d] in a GGUF
        if leaf[0] == "router_kernel":
            candidates = [f"{base}.{pre}.gate.weight" for pre in _MOE_PREFIXES]
            name = _first_present(source, candidates) or candidates[0]
            return name, _get(source, name).T
        if leaf[0] in _EXPERT_NAMES:
            return f"{base}.mlp.experts.*.{_EXPERT_NAMES[leaf[0]][0]}", None  # filled by caller
    raise CheckpointError(f"no checkpoint tensor known for parameter {'/'.join(map(str, path))}")


def fetch_experts(source: TensorSource, path: tuple, num_experts: int) -> np.ndarray:
    return _experts(source, path[1], path[3], num_experts)

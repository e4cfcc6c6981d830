"""Hugging Face tensor names and layouts for the parameters of a `Decoder` (the inverse of
`cmoe_jax.loading.hf_names`): projections transposed to `[out, in]`, experts of the
original MoE families split one tensor an expert; the carved MoE layers keep cmoe_jax's
names and layouts, which the exported remote code reads as they are.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from cmoe_jax.export.hf_config import ExportError, keeps_original_architecture
from cmoe_jax.models import ModelConfig
from cmoe_jax.models.families import family
from cmoe_jax.models.families.base import ATTENTION as _ATTN, DENSE_MLP as _DENSE_MLP
from cmoe_jax.models.families.base import SHARED_EXPERT as _SHARED_EXPERT


def _t(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.T)


def hf_tensors(cfg: ModelConfig, path: tuple, value: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) pairs of the exported checkpoint for one parameter `path` of the model."""
    if path == ("embed",):
        yield "model.embed_tokens.weight", value
    elif path == ("lm_head",):
        yield "lm_head.weight", _t(value)
    elif path == ("norm", "weight"):
        yield "model.norm.weight", value
    elif path[0] == "layers" and path[2] in family(cfg.model_type).norms:
        yield f"model.layers.{path[1]}.{family(cfg.model_type).norms[path[2]]}.weight", value
    elif path[0] == "layers" and path[2] == "attn":
        base = f"model.layers.{path[1]}.self_attn"
        if path[3] in ("q_norm", "k_norm"):
            yield f"{base}.{path[3]}.weight", value
        else:
            yield f"{base}.{_ATTN[path[3]]}", (_t(value) if value.ndim == 2 else value)
    elif path[0] == "layers" and path[2] == "mlp":
        yield from _mlp_tensors(cfg, path[1], path[3], value)
    else:
        raise ExportError(f"no exported tensor for parameter {'/'.join(map(str, path))}")


def _mlp_tensors(cfg: ModelConfig, layer: int, leaf: str, value: np.ndarray):
    base = f"model.layers.{layer}"
    if leaf in _DENSE_MLP and cfg.ffn_spec(layer) is None:
        yield f"{base}.mlp.{_DENSE_MLP[leaf]}.weight", _t(value)
    elif not keeps_original_architecture(cfg):  # the remote code's MoEMLP, cmoe_jax layout
        yield f"{base}.mlp.{leaf}", (value.astype(np.int32) if leaf == "slot_map" else value)
    elif leaf in _SHARED_EXPERT:
        yield f"{base}.mlp.{_SHARED_EXPERT[leaf]}.weight", _t(value)
    elif leaf == "router_kernel":
        yield f"{base}.{family(cfg.model_type).moe_prefix}.gate.weight", _t(value)
    elif leaf in family(cfg.model_type).experts:
        prefix, names = family(cfg.model_type).moe_prefix, family(cfg.model_type).experts
        for e in range(value.shape[0]):
            yield f"{base}.{prefix}.experts.{e}.{names[leaf]}.weight", _t(value[e])
    else:
        raise ExportError(f"no exported tensor for layer {layer}'s {leaf}")

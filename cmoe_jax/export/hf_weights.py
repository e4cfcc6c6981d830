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

_ATTN = {"q_proj": "q_proj.weight", "k_proj": "k_proj.weight", "v_proj": "v_proj.weight",
         "o_proj": "o_proj.weight", "q_bias": "q_proj.bias", "k_bias": "k_proj.bias",
         "v_bias": "v_proj.bias"}
_NORMS = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm"}
_DENSE_MLP = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_EXPERTS = {"qwen3_moe": ("mlp", {"expert_gate": "gate_proj", "expert_up": "up_proj",
                                  "expert_down": "down_proj"}),
            "mixtral": ("block_sparse_moe", {"expert_gate": "w1", "expert_up": "w3",
                                             "expert_down": "w2"})}


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
    elif path[0] == "layers" and path[2] in _NORMS:
        yield f"model.layers.{path[1]}.{_NORMS[path[2]]}.weight", value
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
    elif not keeps_original_architecture(cfg):
        yield f"{base}.mlp.{leaf}", value  # the remote code's MoEMLP, cmoe_jax layout
    elif leaf == "router_kernel":
        yield f"{base}.{_EXPERTS[cfg.model_type][0]}.gate.weight", _t(value)
    elif leaf in _EXPERTS.get(cfg.model_type, ("", {}))[1]:
        prefix, names = _EXPERTS[cfg.model_type]
        for e in range(value.shape[0]):
            yield f"{base}.{prefix}.experts.{e}.{names[leaf]}.weight", _t(value[e])
    else:
        raise ExportError(f"no exported tensor for layer {layer}'s {leaf}")

"""Hugging Face tensor names and layouts for the parameters of a `Decoder` (the inverse of
`cmoe_jax.loading.hf_names`, with the same family tables): projections transposed to
`[out, in]`, experts of the original MoE families split one tensor an expert, a family's
fused tensors (Phi-3) written whole; the carved MoE layers keep cmoe_jax's names and
layouts, which the exported remote code reads as they are.
"""
from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np

from cmoe_jax.export.hf_config import ExportError, keeps_original_architecture
from cmoe_jax.models import ModelConfig


def _t(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.T)


def _layer_path(cfg: ModelConfig, layer: int, rel: str) -> tuple:
    """Our parameter path of the unfused tensor `rel` (under model.layers.N.)."""
    fam = cfg.family
    tables = (("attn", "self_attn.", fam.attention, ""), ("mlp", "mlp.", fam.dense_mlp, ".weight"))
    for module, prefix, names, suffix in tables:
        leaf = next((ours for ours, hf in names.items() if prefix + hf + suffix == rel), None)
        if leaf is not None:
            return ("layers", layer, module, leaf)
    raise ExportError(f"the family's fused tensor part {rel!r} is none of its attention or MLP tensors")


def _unfused(cfg: ModelConfig, path: tuple, value: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    if path == ("embed",):
        yield "model.embed_tokens.weight", value
    elif path == ("lm_head",):
        yield "lm_head.weight", _t(value)
    elif path == ("norm", "weight"):
        yield "model.norm.weight", value
    elif path[0] == "layers" and path[2] in cfg.family.norms:
        yield f"model.layers.{path[1]}.{cfg.family.norms[path[2]]}.weight", value
    elif path[0] == "layers" and path[2] == "attn":
        base = f"model.layers.{path[1]}.self_attn"
        if path[3] in ("q_norm", "k_norm"):
            yield f"{base}.{path[3]}.weight", value
        else:
            yield f"{base}.{cfg.family.attention[path[3]]}", (_t(value) if value.ndim == 2 else value)
    elif path[0] == "layers" and path[2] == "mlp":
        yield from _mlp_tensors(cfg, path[1], path[3], value)
    else:
        raise ExportError(f"no exported tensor for parameter {'/'.join(map(str, path))}")


def hf_tensors(cfg: ModelConfig, path: tuple, values: Mapping) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) pairs of the exported checkpoint for one parameter `path` of the model
    (`values`: every parameter's array by path). A part of a family's fused tensor yields
    the whole tensor when it is the first part, and nothing otherwise."""
    for name, array in _unfused(cfg, path, np.asarray(values[path], np.float32)):
        base, _, rel = name.partition(".layers.")
        layer, _, rel = rel.partition(".")
        fused = next((f for f in cfg.family.fused if rel in f.parts), None)
        if fused is None:
            yield name, array
        elif rel == fused.parts[0]:  # this part's array, then the others' (their own paths yield nothing)
            others = [next(_unfused(cfg, p, np.asarray(values[p], np.float32)))[1]
                      for p in (_layer_path(cfg, int(layer), part) for part in fused.parts[1:])]
            yield f"{base}.layers.{layer}.{fused.name}", np.concatenate([array, *others], axis=0)


def _mlp_tensors(cfg: ModelConfig, layer: int, leaf: str, value: np.ndarray):
    base, fam = f"model.layers.{layer}", cfg.family
    if leaf in fam.dense_mlp and cfg.ffn_spec(layer) is None:
        yield f"{base}.mlp.{fam.dense_mlp[leaf]}.weight", _t(value)
    elif not keeps_original_architecture(cfg):  # the remote code's MoEMLP, cmoe_jax layout
        yield f"{base}.mlp.{leaf}", (value.astype(np.int32) if leaf == "slot_map" else value)
    elif leaf in fam.shared_expert:
        yield f"{base}.mlp.{fam.shared_expert[leaf]}.weight", _t(value)
    elif leaf == "router_kernel":
        yield f"{base}.{fam.moe_prefix}.gate.weight", _t(value)
    elif leaf in fam.experts:
        for e in range(value.shape[0]):
            yield f"{base}.{fam.moe_prefix}.experts.{e}.{fam.experts[leaf]}.weight", _t(value[e])
    else:
        raise ExportError(f"no exported tensor for layer {layer}'s {leaf}")

"""Where each parameter of `cmoe_jax.models.Decoder` comes from in a Hugging Face checkpoint.

Every name comes from the model's family unit (`cfg.family`): its norms, attention, dense
MLP, shared expert and per-expert names, the module holding its MoE block, and the fused
tensors it splits (Phi-3). Expert stacks also come in two family-independent layouts:
transformers 5 in memory (gate and up fused as `experts.gate_up_proj [E, 2m, d]`) and
llama.cpp's GGUF (`experts.gate_proj.weight [E, m, d]`, unfused).

`fetch(source, path, cfg)` returns the numpy array for one parameter path, already in JAX
layout ([in, out] projections, experts stacked on a leading axis).
"""
from __future__ import annotations

import numpy as np

from cmoe_jax.errors import CheckpointError
from cmoe_jax.loading.sources import TensorSource
from cmoe_jax.models import ModelConfig
from cmoe_jax.models.families.base import EXPERTS as STACKED_EXPERTS

EXPERT_LEAVES = tuple(STACKED_EXPERTS)  # expert_gate, expert_up, expert_down


def _missing(name: str) -> CheckpointError:
    return CheckpointError(f"tensor {name!r} is missing from the checkpoint: the config does "
                           "not match the weights, or the file is incomplete")


def _get(source: TensorSource, cfg: ModelConfig, name: str) -> np.ndarray:
    """Tensor `name`, or its rows of the family's fused tensor that holds it."""
    if name in source:
        return source.get(name)
    base, _, rel = name.partition(".layers.")
    layer, _, rel = rel.partition(".")
    for fused in cfg.family.fused:
        whole = f"{base}.layers.{layer}.{fused.name}"
        if rel in fused.parts and whole in source:
            ends = np.cumsum((0, *fused.rows(cfg)))
            i = fused.parts.index(rel)
            return source.get(whole)[ends[i]:ends[i + 1]]
    raise _missing(name)


def _moe_prefixes(cfg: ModelConfig) -> tuple[str, ...]:
    """The family's MoE module, then transformers 5's and llama.cpp's ("mlp")."""
    return tuple(dict.fromkeys((cfg.family.moe_prefix, "mlp")))


def fetch_experts(source: TensorSource, cfg: ModelConfig, layer: int, leaf: str,
                  num_experts: int) -> np.ndarray:
    """Expert weights `leaf` of `layer` stacked `[E, in, out]`, from whichever layout the
    checkpoint holds."""
    base = f"model.layers.{layer}"
    for pre in _moe_prefixes(cfg):
        for suffix in ("", ".weight"):
            stacked = f"{base}.{pre}.experts.{STACKED_EXPERTS[leaf]}{suffix}"
            if stacked in source:
                return np.ascontiguousarray(np.swapaxes(source.get(stacked), 1, 2))
        fused = f"{base}.{pre}.experts.gate_up_proj"
        if leaf != "expert_down" and fused in source:
            w = source.get(fused)
            half = w.shape[1] // 2
            w = w[:, :half] if leaf == "expert_gate" else w[:, half:]
            return np.ascontiguousarray(np.swapaxes(w, 1, 2))
    name = f"{base}.{cfg.family.moe_prefix}.experts.{{}}.{cfg.family.experts[leaf]}.weight"
    return np.stack([_get(source, cfg, name.format(e)).T for e in range(num_experts)])


_AS_IS = lambda w: w  # noqa: E731
_PROJECTION = lambda w: w.T if w.ndim == 2 else w  # [out, in] -> [in, out]; a bias as is  # noqa: E731


def _layer_tensor(cfg: ModelConfig, module: str, leaf: tuple):
    """(name under model.layers.N., its layout change), or None when the family has none."""
    fam = cfg.family
    if module in fam.norms:
        return f"{fam.norms[module]}.weight", _AS_IS
    if module == "attn":
        if leaf[0] in ("q_norm", "k_norm"):
            return f"self_attn.{leaf[0]}.weight", _AS_IS
        return f"self_attn.{fam.attention[leaf[0]]}", _PROJECTION
    if module == "mlp" and leaf[0] in fam.dense_mlp:
        return f"mlp.{fam.dense_mlp[leaf[0]]}.weight", _PROJECTION
    if module == "mlp" and leaf[0] in fam.shared_expert:  # Qwen2-MoE's; its gate is [d] in a GGUF
        return f"mlp.{fam.shared_expert[leaf[0]]}.weight", lambda w: np.atleast_2d(w).T
    return None


def fetch(source: TensorSource, path: tuple, cfg: ModelConfig) -> tuple[str, np.ndarray]:
    """(checkpoint name, array in JAX layout) for one Decoder parameter path (not an expert
    stack: `fetch_experts`)."""
    top = {("embed",): ("model.embed_tokens.weight", _AS_IS), ("lm_head",): ("lm_head.weight", _PROJECTION),
           ("norm", "weight"): ("model.norm.weight", _AS_IS)}
    found = top.get(path)
    if found is not None:
        return found[0], found[1](_get(source, cfg, found[0]))
    found = _layer_tensor(cfg, path[2], path[3:]) if path[0] == "layers" else None
    if found is None and path[0] == "layers" and path[3:] == ("router_kernel",):
        names = [f"model.layers.{path[1]}.{pre}.gate.weight" for pre in _moe_prefixes(cfg)]
        name = next((n for n in names if n in source), names[0])
        return name, _get(source, cfg, name).T
    if found is None:
        raise CheckpointError(f"no checkpoint tensor known for parameter {'/'.join(map(str, path))}")
    name = f"model.layers.{path[1]}.{found[0]}"
    return name, found[1](_get(source, cfg, name))

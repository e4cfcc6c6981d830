"""A `config.json` for transformers from a cmoe_jax `ModelConfig` (the inverse of `from_hf`).

Dense models and the MoE families transformers knows (Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral:
routers and shapes unchanged) get their original architecture. Models whose FFNs were carved
or compressed into a shape transformers has no class for (CMoE's router, a shared MLP beside
the experts, hierarchical sub-experts, ConMoE's prototype table behind the router's slots)
get the base family's config plus `moe_layers` and an `auto_map` to `modeling_cmoe.py`, the
remote code written beside the weights.
"""
from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

from cmoe_jax.errors import CmoeError
from cmoe_jax.models import ModelConfig, carved_export
from cmoe_jax.models.families import FAMILIES
from cmoe_jax.moe.activations import to_hf_name
from cmoe_jax.moe.routers import ROUTERS, Routing
from cmoe_jax.moe.routers.base import options_of
from cmoe_jax.moe.spec import FFNSpec, has_torch_form

_NO_OPTIONS = options_of(FFNSpec(1, 1, 1))  # what a family's own MoE class routes with

REMOTE_CODE = "modeling_cmoe.py"


class ExportError(CmoeError):
    """A model the chosen export format cannot represent."""


def _rope(cfg: ModelConfig) -> dict:
    params = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        scaling = dict(cfg.rope_scaling)
        if scaling.get("rope_type") == "freq_factors":
            raise ExportError("the model uses llama.cpp's per-frequency RoPE factors (GGUF "
                              "rope_freqs), which transformers configs cannot express")
        params.update(scaling)
    return params


def keeps_original_architecture(cfg: ModelConfig) -> bool:
    """Dense, or the unchanged MoE layers of a sparse family (its unit's `own_moe`): never a
    hierarchical layer (sub-experts), a ConMoE one (prototype table behind the slots) or a
    router with an optional setting (balancing bias, sigmoid scores, gate scale, jitter)."""
    specs = [s for s in cfg.moe_layers if s is not None]
    plain = all(s.sub_experts == 0 and s.num_prototypes == 0 and options_of(s) == _NO_OPTIONS for s in specs)
    return not specs or (plain and cfg.family.own_moe(cfg, specs))




def _moe_layer(spec, d_model: int, activation: str) -> dict | None:
    """One `moe_layers` entry: the spec's fields, and its router's arrays as
    `router_params` (role -> [name, shape, init]) so the remote code declares them."""
    if spec is None:
        return None
    d = dataclasses.asdict(spec)
    other = [f.name for f in dataclasses.fields(spec) if not has_torch_form(f) and d[f.name] != f.default]
    unit = ROUTERS.get(spec.router)
    if other or unit is None or unit.torch_route is None:
        raise ExportError(f"MoE layers with {', '.join(other) or 'router ' + spec.router!s} have "
                          "no transformers form yet (remote code covers the routers with a "
                          "torch_route, hierarchical and ConMoE layers, with an optional shared MLP)")
    routing = Routing.of(spec, activation)
    top = spec.sub_experts > 0
    params = {role: [p.attr(top), list(p.shape), p.init] for role, p in unit.params(d_model, routing).items()}
    return {**{f.name: d[f.name] for f in dataclasses.fields(spec) if has_torch_form(f)}, "router_params": params}


def remote_code(cfg: ModelConfig) -> str:
    """`modeling_cmoe.py` for `cfg`: the module beside this one plus the torch routing of
    each router kind its layers use (`Router.torch_route`, registered in `ROUTES`)."""
    text = (Path(__file__).parent / "hf_remote" / REMOTE_CODE).read_text()
    for kind in sorted({s.router for s in cfg.moe_layers if s is not None}):
        fn = ROUTERS[kind].torch_route
        text += f"\n\n{inspect.getsource(fn)}\n\nROUTES[{kind!r}] = {fn.__name__}\n"
    return text


def hf_config(cfg: ModelConfig) -> dict:
    """config.json contents for `cfg` (raises ExportError when no form can hold it)."""
    out = {"model_type": cfg.model_type, "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
           "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
           "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
           "hidden_act": to_hf_name(cfg.activation), "rms_norm_eps": cfg.rms_norm_eps,
           "max_position_embeddings": cfg.max_position_embeddings,
           "tie_word_embeddings": cfg.tie_word_embeddings, "rope_parameters": _rope(cfg),
           "torch_dtype": "float32", "dtype": "float32"}
    unit = cfg.family
    out.update(unit.export(cfg))
    out = {k: v for k, v in out.items() if k not in unit.export_drops}
    if keeps_original_architecture(cfg):
        out["architectures"] = [unit.architecture]
        return out
    if unit.remote is None:
        remote = [f.model_type for f in FAMILIES.values() if f.remote]
        raise ExportError(f"a carved {cfg.model_type} model has no transformers form yet "
                          f"(remote code covers carved {', '.join(remote)} models)")
    name = unit.remote
    out.update(model_type=carved_export.PREFIX + cfg.model_type, architectures=[f"{name}ForCausalLM"],
               moe_layers=[_moe_layer(s, cfg.hidden_size, cfg.activation) for s in cfg.moe_layers],
               auto_map={"AutoConfig": f"modeling_cmoe.{name}Config",
                         "AutoModelForCausalLM": f"modeling_cmoe.{name}ForCausalLM"})
    return out

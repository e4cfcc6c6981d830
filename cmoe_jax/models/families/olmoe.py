"""OLMoE: a Llama-like decoder whose every FFN is a softmax top-k MoE (64 experts, top 8 in
OLMoE-1B-7B), with q/k RMSNorm over the whole projection (all heads at once)."""
from __future__ import annotations

from cmoe_jax.errors import UnsupportedModelError
from cmoe_jax.models.families.base import GGUF_EXPERTS, Family, gguf_experts
from cmoe_jax.moe.routers import get_router
from cmoe_jax.moe.spec import FFNSpec


def _parse(get) -> dict:
    for key in ("clip_qkv",):
        if get(key) is not None:
            raise UnsupportedModelError(f"olmoe with {key}={get(key)} is not supported")
    if get("attention_bias"):
        raise UnsupportedModelError("olmoe with attention_bias is not supported")
    spec = FFNSpec(get("num_experts"), get("num_experts_per_tok"), get("intermediate_size"), 0,
                   "linear", bool(get("norm_topk_prob", False)))
    return {"qk_norm": True, "qk_norm_scope": "all",
            "moe_layers": (spec,) * get("num_hidden_layers")}


def _own(cfg, specs) -> bool:
    return len(specs) == cfg.num_layers and len(set(specs)) == 1 and all(
        get_router(s.router).checkpoint_router and s.shared_width == 0 and s.expert_width == cfg.intermediate_size
        for s in specs)


def _export(cfg) -> dict:
    specs = [s for s in cfg.moe_layers if s is not None]
    if not specs:
        return {}
    return dict(num_experts=specs[0].num_experts, num_experts_per_tok=specs[0].top_k,
                norm_topk_prob=specs[0].norm_topk_prob)


def _gguf_config(field) -> dict:
    """llama.cpp's olmoe: the expert width is `feed_forward_length` (intermediate_size), the
    top-k gates never renormalised."""
    return gguf_experts("olmoe", field, False, width=None)


OLMOE = Family("olmoe", "OlmoeForCausalLM", _parse, _export, remote="CmoeOlmoe", own_moe=_own,
               gguf_arch="olmoe", gguf_layer=GGUF_EXPERTS, gguf_config=_gguf_config, gguf_moe=True)

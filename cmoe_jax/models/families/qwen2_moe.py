"""Qwen2-MoE / Qwen1.5-MoE: Qwen2 attention (q/k/v biases) and MoE FFNs with a shared expert
beside the routed ones, its output scaled by a sigmoid gate `sigmoid(x W_sg)` (the
shared-expert shape of DeepSeek-MoE)."""
from __future__ import annotations

from cmoe_jax.errors import UnsupportedModelError
from cmoe_jax.models.families.base import GGUF_SHARED_EXPERT, Family, gguf_experts
from cmoe_jax.moe.routers import get_router
from cmoe_jax.moe.spec import FFNSpec


def _parse(get) -> dict:
    n, num_experts = get("num_hidden_layers"), get("num_experts") or 0
    if get("use_sliding_window"):
        raise UnsupportedModelError("qwen2_moe with use_sliding_window is not supported")
    spec = FFNSpec(num_experts, get("num_experts_per_tok"), get("moe_intermediate_size"),
                   get("shared_expert_intermediate_size") or 0, "linear",
                   bool(get("norm_topk_prob", False)), shared_gated=True)
    step = get("decoder_sparse_step", 1) or 1
    dense_only = set(get("mlp_only_layers", []) or [])
    layers = tuple(spec if (i not in dense_only and num_experts > 0 and (i + 1) % step == 0)
                   else None for i in range(n))
    return {"attention_bias": bool(get("qkv_bias", True)), "moe_layers": layers}


def _own(cfg, specs) -> bool:
    return len(set(specs)) == 1 and all(get_router(s.router).checkpoint_router and s.shared_gated for s in specs)


def _export(cfg) -> dict:
    specs = [s for s in cfg.moe_layers if s is not None]
    out = {"qkv_bias": cfg.attention_bias, "use_sliding_window": False}
    if specs:
        s = specs[0]
        out.update(num_experts=s.num_experts, num_experts_per_tok=s.top_k,
                   moe_intermediate_size=s.expert_width, norm_topk_prob=s.norm_topk_prob,
                   shared_expert_intermediate_size=s.shared_width, decoder_sparse_step=1,
                   mlp_only_layers=[i for i, x in enumerate(cfg.moe_layers) if x is None])
    return out


def _gguf_config(field) -> dict:
    """llama.cpp's qwen2moe: routed and shared expert widths, gates not renormalised."""
    return {**gguf_experts("qwen2moe", field, False),
            "shared_expert_intermediate_size": field("qwen2moe.expert_shared_feed_forward_length")}


QWEN2_MOE = Family("qwen2_moe", "Qwen2MoeForCausalLM", _parse, _export, remote="CmoeQwen2Moe",
                   own_moe=_own, gguf_arch="qwen2moe", gguf_layer=GGUF_SHARED_EXPERT,
                   gguf_config=_gguf_config, gguf_moe=True)

"""Qwen2/2.5 (q/k/v biases), Qwen3 (q/k RMSNorm) and Qwen3-MoE."""
from __future__ import annotations

from cmoe_jax.models.families.base import GGUF_EXPERTS, Family, gguf_experts
from cmoe_jax.moe.routers import get_router
from cmoe_jax.moe.spec import FFNSpec


def _qwen2(get) -> dict:
    return {"attention_bias": True}  # Qwen2 always carries q/k/v biases


def _qwen3(get) -> dict:
    return {"qk_norm": True, "attention_bias": bool(get("attention_bias", False))}


def _qwen3_moe(get) -> dict:
    num_layers = get("num_hidden_layers")
    num_experts = get("num_experts") or get("num_local_experts") or 0
    spec = FFNSpec(num_experts, get("num_experts_per_tok"), get("moe_intermediate_size"), 0,
                   "linear", bool(get("norm_topk_prob", False)))
    step = get("decoder_sparse_step", 1) or 1
    dense_only = set(get("mlp_only_layers", []) or [])
    layers = tuple(spec if (i not in dense_only and num_experts > 0 and (i + 1) % step == 0)
                   else None for i in range(num_layers))
    return {**_qwen3(get), "moe_layers": layers}


def _qwen3_moe_own(cfg, specs) -> bool:
    return len({(s.num_experts, s.top_k, s.expert_width, s.norm_topk_prob) for s in specs}) == 1 \
        and all(get_router(s.router).checkpoint_router and s.shared_width == 0 for s in specs)


def _export_qwen3_moe(cfg) -> dict:
    specs = [s for s in cfg.moe_layers if s is not None]
    if not specs:
        return {}
    s = specs[0]
    return dict(num_experts=s.num_experts, num_experts_per_tok=s.top_k,
                moe_intermediate_size=s.expert_width, norm_topk_prob=s.norm_topk_prob,
                decoder_sparse_step=1,
                mlp_only_layers=[i for i, x in enumerate(cfg.moe_layers) if x is None])


QWEN2 = Family("qwen2", "Qwen2ForCausalLM", _qwen2, remote="CmoeQwen2", gguf_arch="qwen2")
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", _qwen3, remote="CmoeQwen3", gguf_arch="qwen3")
QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", _qwen3_moe, _export_qwen3_moe,
                   remote="CmoeQwen3Moe", own_moe=_qwen3_moe_own, gguf_arch="qwen3moe",
                   gguf_layer=GGUF_EXPERTS, gguf_moe=True,  # llama.cpp renormalises the top-k gates
                   gguf_config=lambda field: gguf_experts("qwen3moe", field, True))

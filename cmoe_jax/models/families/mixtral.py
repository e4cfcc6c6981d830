"""Mixtral: every FFN a top-k MoE with renormalised gates, experts named w1/w3/w2."""
from __future__ import annotations

from types import MappingProxyType

from cmoe_jax.models.families.base import GGUF_EXPERTS, Family, gguf_experts
from cmoe_jax.moe.routers import get_router
from cmoe_jax.moe.spec import FFNSpec


def _parse(get) -> dict:
    spec = FFNSpec(get("num_local_experts"), get("num_experts_per_tok"),
                   get("intermediate_size"), 0, "linear", True)
    return {"moe_layers": (spec,) * get("num_hidden_layers"),
            "sliding_window": int(get("sliding_window") or 0)}


def _own(cfg, specs) -> bool:
    return all(get_router(s.router).checkpoint_router and s.shared_width == 0 and s.norm_topk_prob
               and s.expert_width == cfg.intermediate_size for s in specs)


def _export(cfg) -> dict:
    specs = [s for s in cfg.moe_layers if s is not None]
    out = {"sliding_window": cfg.sliding_window or None}
    if specs:
        out.update(num_local_experts=specs[0].num_experts, num_experts_per_tok=specs[0].top_k)
    return out


def _gguf_config(field) -> dict:
    """llama.cpp writes Mixtral as a "llama" with expert tensors (Q/K permuted, gates
    renormalised, no sliding window)."""
    return {**gguf_experts("llama", field, True, experts="num_local_experts", width=None),
            "sliding_window": None}


MIXTRAL = Family("mixtral", "MixtralForCausalLM", _parse, _export, moe_prefix="block_sparse_moe",
                 experts=MappingProxyType({"expert_gate": "w1", "expert_up": "w3",
                                           "expert_down": "w2"}), own_moe=_own,
                 remote="CmoeMixtral", gguf_arch="llama", gguf_moe=True, gguf_layer=GGUF_EXPERTS,
                 gguf_permute_qk=True, gguf_config=_gguf_config)

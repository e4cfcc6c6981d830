"""Phi-3: a Llama decoder whose checkpoints fuse q/k/v into one `qkv_proj` and gate/up into
one `gate_up_proj` (declared as `Fused`, so loading splits them and export joins them), with
a sliding window over every layer when its config sets one."""
from __future__ import annotations

from cmoe_jax.errors import UnsupportedModelError
from cmoe_jax.models.families.base import Family, Fused


def _parse(get) -> dict:
    rope = get("rope_parameters") or get("rope_scaling") or {}
    if float(rope.get("partial_rotary_factor", get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise UnsupportedModelError("phi3: partial rotary embeddings (partial_rotary_factor < 1, "
                                    "as in Phi-4-mini) are not supported")
    return {"sliding_window": int(get("sliding_window") or 0)}


def _export(cfg) -> dict:
    # Phi3Config's default pad_token_id (32000) would be an embedding row past a smaller
    # vocabulary; the padding row only matters when training embeddings from scratch
    return {"sliding_window": cfg.sliding_window or None, "pad_token_id": None}


QKV = Fused("self_attn.qkv_proj.weight",
            ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
            lambda cfg: (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                         cfg.num_kv_heads * cfg.head_dim))
GATE_UP = Fused("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                lambda cfg: (cfg.intermediate_size, cfg.intermediate_size))

PHI3 = Family("phi3", "Phi3ForCausalLM", _parse, _export, remote="CmoePhi3", fused=(QKV, GATE_UP))

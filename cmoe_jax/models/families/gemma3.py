"""Gemma 3 text models (`gemma3_text`).

Against Llama: local sliding-window layers between global ones (`layer_types`), each kind
with its own RoPE base; q/k RMSNorm; four norms a layer (after attention and after the FFN
too, before the residual add); RMSNorm weights applied as `1 + w`; a GELU-tanh GLU; the
embedding scaled by sqrt(hidden_size); queries scaled by `query_pre_attn_scalar ** -0.5`;
the LM head tied to the embedding.
"""
from __future__ import annotations

from types import MappingProxyType

from cmoe_jax.errors import UnsupportedModelError
from cmoe_jax.models.families.base import GGUF_LAYER, Family
from cmoe_jax.moe.activations import from_hf_name, to_hf_name

SLIDING, FULL = "sliding_attention", "full_attention"


def _rope(get) -> tuple[dict, dict]:
    """(global, local) RoPE parameters from a transformers config or a config.json of
    either form (nested `rope_parameters`, or `rope_theta` + `rope_local_base_freq`)."""
    params = get("rope_parameters") or {}
    if FULL in params:
        return dict(params[FULL]), dict(params.get(SLIDING) or {"rope_theta": 10000.0})
    full = dict(get("rope_scaling") or {})
    full["rope_theta"] = params.get("rope_theta", get("rope_theta", 1_000_000.0))
    return full, {"rope_theta": get("rope_local_base_freq", 10000.0)}


def _parse(get) -> dict:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if get(key) is not None:
            raise UnsupportedModelError(f"gemma3_text with {key}={get(key)} is not supported "
                                        "(Gemma 3 checkpoints have none)")
    if get("use_bidirectional_attention"):
        raise UnsupportedModelError("gemma3_text with bidirectional attention is not supported")
    n = get("num_hidden_layers")
    types = get("layer_types")
    if not types:
        pattern = get("sliding_window_pattern", 6) or 6
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    full, local = _rope(get)
    if dict(local).get("rope_type", "default") != "default":
        raise UnsupportedModelError("gemma3_text: RoPE scaling on the sliding layers is not supported")
    scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    return {"activation": from_hf_name(get("hidden_activation") or "gelu_pytorch_tanh"),
            "qk_norm": True, "attention_bias": bool(get("attention_bias", False)),
            "sliding_window": int(get("sliding_window") or 0), "layer_types": tuple(types),
            "rope_theta": float(full["rope_theta"]), "rope_local_theta": float(local["rope_theta"]),
            "rope_scaling": scaling if scaling.get("rope_type", "default") != "default" else None,
            "embed_scale": float(get("hidden_size")) ** 0.5, "norm_offset": 1.0,
            "sandwich_norms": True, "query_scale": float(get("query_pre_attn_scalar", 256)) ** -0.5,
            "tie_word_embeddings": bool(get("tie_word_embeddings", True))}


def _export(cfg) -> dict:
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta, **dict(cfg.rope_scaling or {})}
    return {"hidden_activation": to_hf_name(cfg.activation),
            "query_pre_attn_scalar": int(round(cfg.query_scale ** -2)),
            "sliding_window": cfg.sliding_window, "layer_types": list(cfg.layer_types),
            "attention_bias": cfg.attention_bias,
            "rope_parameters": {FULL: full, SLIDING: {"rope_type": "default",
                                                      "rope_theta": cfg.rope_local_theta}}}


def _gguf_config(field) -> dict:
    """What llama.cpp's gemma3 GGUF says beyond the shared fields; llama.cpp fixes the
    rest (every 6th layer global, local RoPE base 10000, queries scaled by head_dim)."""
    return {"sliding_window": field("gemma3.attention.sliding_window"),
            "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6,
            "query_pre_attn_scalar": field("gemma3.attention.key_length"),
            "hidden_activation": "gelu_pytorch_tanh"}


GEMMA3_TEXT = Family(
    "gemma3_text", "Gemma3ForCausalLM", _parse, _export, ("hidden_act",), remote="CmoeGemma3",
    norms=MappingProxyType({"input_norm": "input_layernorm",
                            "attn_out_norm": "post_attention_layernorm",
                            "post_attn_norm": "pre_feedforward_layernorm",
                            "ffn_out_norm": "post_feedforward_layernorm"}),
    gguf_arch="gemma3",
    gguf_layer=MappingProxyType({**GGUF_LAYER, "post_attention_norm": "post_attention_layernorm",
                                 "ffn_norm": "pre_feedforward_layernorm",
                                 "post_ffw_norm": "post_feedforward_layernorm"}),
    gguf_norm_shift=1.0, gguf_config=_gguf_config, bos_per_window=True)

"""Llama 1/2/3 and Mistral (Llama with a sliding attention window)."""
from __future__ import annotations

from cmoe_jax.models.families.base import Family


def _llama(get) -> dict:
    return {"attention_bias": bool(get("attention_bias", False))}


def _export_llama(cfg) -> dict:
    return {"attention_bias": cfg.attention_bias}


def _mistral(get) -> dict:
    # transformers' mask: a query at q sees keys k with q - window < k <= q
    return {"sliding_window": int(get("sliding_window") or 0)}


def _export_mistral(cfg) -> dict:
    return {"sliding_window": cfg.sliding_window or None}  # None: no window (not the 4096 default)


LLAMA = Family("llama", "LlamaForCausalLM", _llama, _export_llama, remote="CmoeLlama",
               gguf_arch="llama", gguf_permute_qk=True)
MISTRAL = Family("mistral", "MistralForCausalLM", _mistral, _export_mistral, remote="CmoeMistral")

"""Plain model configuration shared by every decoder family.

One frozen dataclass covers Llama 1/2/3, Qwen2/2.5, Qwen3, Qwen3-MoE and Mixtral: the
families differ only in a few switches (q/k/v biases, q/k RMSNorm, sparse FFN layers).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from cmoe_jax.errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")


@dataclasses.dataclass(frozen=True)
class FFNSpec:
    """Shape of one MoE FFN layer (sparse checkpoints and converted models).

    `router` is "linear" for Qwen3-MoE/Mixtral/ExpertWeaver, "cmoe" for the analytical
    router of a carved model. `shared_width` is the width of the fused always-on MLP.
    `router_neurons` is how many representative neurons score each expert (cmoe router).
    `num_prototypes` > 0 (ConMoE, `cmoe_jax.compress`): the layer stores that many prototype
    experts and an int32 slot -> prototype map (-1: slot pruned); `prototype_owner` >= 0
    names the layer whose prototype table this layer shares (a cross-layer scope);
    `duplicate_gates` is how a token's gates on slots sharing a prototype combine
    (`cmoe_jax.moe.prototypes`: "sum", the paper's, "max" or "renorm").
    """

    num_experts: int
    top_k: int
    expert_width: int
    shared_width: int = 0
    router: str = "linear"
    norm_topk_prob: bool = False
    router_neurons: int = 1
    # Hierarchical CMoE (`cmoe_jax.moe.hierarchical`): with sub_experts N' > 0 each of the
    # num_experts experts is split into N' sub-experts of width expert_width (N'_s =
    # sub_shared always on with their expert, sub_top_k of the rest chosen by its sub-router
    # of sub_router_neurons neurons per sub-expert). 0: a plain MoE layer.
    sub_experts: int = 0
    sub_shared: int = 0
    sub_top_k: int = 0
    sub_router_neurons: int = 1
    num_prototypes: int = 0
    prototype_owner: int = -1
    duplicate_gates: str = "sum"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    # Per-layer MoE FFNs; None entries are dense SwiGLU layers. Empty means all dense.
    moe_layers: tuple[FFNSpec | None, ...] = ()

    def ffn_spec(self, layer: int) -> FFNSpec | None:
        return self.moe_layers[layer] if self.moe_layers else None

    def with_moe_layers(self, specs) -> "ModelConfig":
        specs = tuple(specs)
        if len(specs) != self.num_layers:
            raise ValueError(f"need {self.num_layers} FFN specs, got {len(specs)}")
        return dataclasses.replace(self, moe_layers=specs)

    # ---- serialisation (manifests, converted checkpoints) -------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        d["moe_layers"] = [dataclasses.asdict(s) if s else None for s in self.moe_layers]
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "ModelConfig":
        d = dict(d)
        rs = d.get("rope_scaling")
        d["rope_scaling"] = _frozen_items(rs) if rs else None
        d["moe_layers"] = tuple(FFNSpec(**s) if s else None for s in d.get("moe_layers", ()))
        return cls(**d)

    # ---- Hugging Face configs -------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        """Build from a `transformers` config object or a raw `config.json` dict."""
        get = (lambda k, default=None: hf.get(k, default)) if isinstance(hf, Mapping) else (
            lambda k, default=None: getattr(hf, k, default))
        model_type = get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r}: cmoe_jax supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        num_heads = get("num_attention_heads")
        hidden = get("hidden_size")
        head_dim = get("head_dim") or hidden // num_heads
        rope = get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", get("rope_theta", 10000.0))
        scaling = get("rope_scaling") or rope
        scaling = {k: v for k, v in dict(scaling).items() if k != "rope_theta"}
        if scaling.get("type") and not scaling.get("rope_type"):
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        num_layers = get("num_hidden_layers")
        moe_layers: tuple = ()
        if model_type in ("qwen3_moe", "mixtral"):
            num_experts = get("num_local_experts") or get("num_experts")
            top_k = get("num_experts_per_tok")
            if model_type == "mixtral":
                spec = FFNSpec(num_experts, top_k, get("intermediate_size"), 0, "linear", True)
                moe_layers = (spec,) * num_layers
            else:
                spec = FFNSpec(num_experts, top_k, get("moe_intermediate_size"), 0, "linear",
                               bool(get("norm_topk_prob", False)))
                step = get("decoder_sparse_step", 1) or 1
                dense_only = set(get("mlp_only_layers", []) or [])
                moe_layers = tuple(
                    spec if (i not in dense_only and num_experts > 0 and (i + 1) % step == 0)
                    else None for i in range(num_layers))
        cfg = cls(
            model_type=model_type,
            vocab_size=get("vocab_size"),
            hidden_size=hidden,
            intermediate_size=get("intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=_frozen_items(scaling) if scaling else None,
            max_position_embeddings=int(get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            # Qwen2 always carries q/k/v biases; Llama/Qwen3 only when attention_bias says so.
            attention_bias=model_type == "qwen2" or bool(get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            moe_layers=moe_layers,
        )
        if cfg.num_heads % cfg.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={cfg.num_heads} is not a multiple of "
                f"num_key_value_heads={cfg.num_kv_heads}")
        return cfg


def _frozen_items(d: Mapping) -> tuple:
    """Sorted (key, value) pairs with lists made tuples, so the config stays hashable."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies, with Llama-3 / linear scaling as `transformers` computes them."""
    dim = cfg.head_dim
    # float32 throughout, as transformers computes it, so long positions match bit-closely.
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(cfg.rope_theta) ** exponent)).astype(np.float32)
    if not cfg.rope_scaling:
        return inv_freq.astype(np.float32)
    s = dict(cfg.rope_scaling)
    kind = s.get("rope_type")
    if kind == "linear":
        return (inv_freq / s["factor"]).astype(np.float32)
    if kind == "freq_factors":  # llama.cpp's per-frequency divisors (GGUF `rope_freqs`)
        factors = np.asarray(s["factors"], dtype=np.float32)
        if factors.shape != inv_freq.shape:
            raise UnsupportedModelError(f"rope_freqs has {factors.size} factors but head_dim "
                                        f"{dim} needs {inv_freq.size}")
        return (inv_freq / factors).astype(np.float32)
    if kind == "llama3":
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        lo_wavelen, hi_wavelen = old_len / lo, old_len / hi
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > lo_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= hi_wavelen) & (wavelen <= lo_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise UnsupportedModelError(f"unsupported rope scaling type {kind!r} (supported: llama3, linear, freq_factors)")

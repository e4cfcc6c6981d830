"""Plain model configuration shared by every decoder family.

One frozen dataclass covers every family in `cmoe_jax.models.families`: the families differ
only in switches (q/k/v biases, q/k RMSNorm, the GLU activation, sliding-window layers,
per-layer RoPE bases, the norm layout, the embedding scale, sparse FFN layers), which each
family's unit reads from its Hugging Face config.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from cmoe_jax.errors import UnsupportedModelError
from cmoe_jax.models import carved_export, config_fields
from cmoe_jax.models.families import FAMILIES, Family, family as family_of
from cmoe_jax.moe.activations import from_hf_name
from cmoe_jax.moe.spec import FFNSpec

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

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
    # the GLU activation (`cmoe_jax.moe.activations`): required, so that no layer of a
    # model silently runs another family's
    activation: str
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    # Per-layer MoE FFNs; None entries are dense SwiGLU layers. Empty means all dense.
    moe_layers: tuple[FFNSpec | None, ...] = ()
    # tokens a sliding-window layer sees, itself included (0: none); `layer_types` names
    # each layer "sliding_attention" or "full_attention" (empty: all sliding when
    # sliding_window is set, else all full)
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float = 0.0  # RoPE base of the sliding layers (0: rope_theta, scaled alike)
    embed_scale: float = 1.0  # the token embedding is multiplied by this (Gemma: sqrt(d))
    norm_offset: float = 0.0  # RMSNorm weights apply as offset + w (Gemma: 1)
    sandwich_norms: bool = False  # norms after attention and after the FFN too (Gemma)
    query_scale: float = 0.0  # attention score scale (0: head_dim ** -0.5)
    qk_norm_scope: str = "head"  # q/k RMSNorm per head, or over "all" heads at once (OLMoE)

    @property
    def family(self) -> Family:
        """The family unit of this model (`cmoe_jax.models.families`): its tensor names,
        config reader and writer, export classes; every reader takes it from here."""
        return family_of(self.model_type)

    def ffn_spec(self, layer: int) -> FFNSpec | None:
        return self.moe_layers[layer] if self.moe_layers else None

    def window(self, layer: int) -> int:
        """Tokens layer `layer` attends over, itself included (0: all before it)."""
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return 0
        return self.sliding_window

    def local_rope(self, layer: int) -> bool:
        """Whether layer `layer` uses the sliding layers' own RoPE base."""
        return bool(self.rope_local_theta) and self.window(layer) > 0

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
    def from_dict(cls, d: Mapping, where="the manifest's model_config") -> "ModelConfig":
        """From `to_dict`'s form (a manifest's `model_config`), every field checked first
        (`where`: the file it came from, for the one-line error)."""
        config_fields.check_manifest_config(d, where, dataclasses.fields(cls), dataclasses.fields(FFNSpec))
        d = dict(d)
        rs = d.get("rope_scaling")
        d["rope_scaling"] = _frozen_items(rs) if rs else None
        d["moe_layers"] = tuple(FFNSpec(**s) if s else None for s in d.get("moe_layers", ()))
        d["layer_types"] = tuple(d.get("layer_types", ()))
        return cls(**d)

    # ---- Hugging Face configs -------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: Any, where="the model's config") -> "ModelConfig":
        """Build from a `transformers` config object or a raw `config.json` dict, every field
        checked first (`where`: the file it came from, for the one-line error)."""
        get = (lambda k, default=None: hf.get(k, default)) if isinstance(hf, Mapping) else (
            lambda k, default=None: getattr(hf, k, default))
        model_type = get("model_type")
        config_fields.check_model_type(model_type, where)
        exported = carved_export.is_carved_export(model_type, get)  # export's form of a carved model
        if exported:
            get = carved_export.base_getter(get)
            model_type = get("model_type")
        try:
            unit = family_of(model_type)
        except UnsupportedModelError as e:
            raise UnsupportedModelError(f"{where}: {e}") from None
        config_fields.check_hf(get, where)
        moe_layers = carved_export.exported_moe_layers(get, where) if exported else None
        try:
            cfg = cls._built_from_hf(get, unit)
        except (TypeError, ValueError, KeyError, AttributeError) as e:  # a field no table knows
            raise config_fields.ConfigFieldError(
                f"{where}: cannot be read as a {model_type} config ({type(e).__name__}: {e}): fix it, "
                "or use a complete, unedited copy of the model") from None
        return cfg if moe_layers is None else cfg.with_moe_layers(moe_layers)

    @classmethod
    def _built_from_hf(cls, get, unit: Family) -> "ModelConfig":
        model_type = get("model_type")
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
        fields = dict(
            model_type=model_type,
            vocab_size=get("vocab_size"),
            hidden_size=hidden,
            intermediate_size=get("intermediate_size"),
            num_layers=get("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            # transformers' configs default to SiLU; Gemma's unit reads its own field
            activation=_activation(get("hidden_act") or "silu"),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=int(get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        )
        fields.update(unit.parse(get))
        if fields["rope_scaling"]:
            fields["rope_scaling"] = _frozen_items(fields["rope_scaling"])
        cfg = cls(**fields)
        if cfg.num_heads % cfg.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={cfg.num_heads} is not a multiple of "
                f"num_key_value_heads={cfg.num_kv_heads}")
        return cfg


def _activation(hf_name: str) -> str:
    try:
        return from_hf_name(hf_name)
    except ValueError as e:
        raise UnsupportedModelError(f"hidden_act: {e}") from None


def _frozen_items(d: Mapping) -> tuple:
    """Sorted (key, value) pairs with lists made tuples, so the config stays hashable."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse RoPE frequencies, with Llama-3 / linear scaling as `transformers` computes them;
    `local`: the sliding layers' own base (`rope_local_theta`, never scaled)."""
    dim = cfg.head_dim
    # float32 throughout, as transformers computes it, so long positions match bit-closely.
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    if local or not cfg.rope_scaling:
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

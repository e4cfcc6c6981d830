"""Every config field a family reads, checked for type and range once, where it enters.

A model's configuration comes from three places: a Hugging Face `config.json`, a GGUF file's
metadata and a converted model's manifest (`model_config`). Each is checked here against one
table before `ModelConfig` is built from it and before any work: a value of the wrong type or
out of range (`"hidden_size": "big"`, a negative size, null where a number is needed, heads
that do not divide the width) is one line naming the file and the field, never a TypeError
deep inside a model.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

from cmoe_jax.errors import CheckpointError
from cmoe_jax.moe.activations import ACTIVATIONS, from_hf_name


class ConfigFieldError(CheckpointError):
    """A config field of a model has the wrong type or is out of range."""


Kind = tuple[str, Callable[[Any], bool]]  # (what a value must be, in words; the test)


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


POSITIVE: Kind = ("a whole number of at least 1", lambda v: _whole(v) and v > 0)
COUNT: Kind = ("a whole number of at least 0", lambda v: _whole(v) and v >= 0)
OWNER: Kind = ("a whole number of at least -1", lambda v: _whole(v) and v >= -1)
POSITIVE_REAL: Kind = ("a finite number above 0", lambda v: _real(v) and v > 0)
REAL_AT_LEAST_0: Kind = ("a finite number of at least 0", lambda v: _real(v) and v >= 0)
REAL: Kind = ("a finite number", _real)
FLAG: Kind = ("true or false", lambda v: isinstance(v, bool))
TEXT: Kind = ("a string", lambda v: isinstance(v, str))
OBJECT: Kind = ("an object", lambda v: isinstance(v, Mapping))
INDICES: Kind = ("a list of layer numbers", lambda v: isinstance(v, list) and all(COUNT[1](x) for x in v))
TOKEN_IDS: Kind = ("a token id or a list of them", lambda v: COUNT[1](v) or (
    isinstance(v, list) and all(COUNT[1](x) for x in v)))
NAMES: Kind = ("a list of strings", lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v))


def _hf_activation(v) -> bool:
    try:
        return from_hf_name(v) is not None
    except (ValueError, TypeError):
        return False


HF_ACTIVATION: Kind = ("a supported activation (silu, gelu_pytorch_tanh, gelu, ...)", _hf_activation)


def optional(kind: Kind) -> Kind:
    return (f"{kind[0]}, or null", lambda v: v is None or kind[1](v))


# ---- config.json (and what a GGUF file's metadata is turned into) --------------------------------
HF_FIELDS: dict[str, Kind] = {
    "model_type": TEXT, "vocab_size": POSITIVE, "hidden_size": POSITIVE, "intermediate_size": POSITIVE,
    "num_hidden_layers": POSITIVE, "num_attention_heads": POSITIVE,
    "num_key_value_heads": optional(POSITIVE), "head_dim": optional(POSITIVE),
    "hidden_act": optional(HF_ACTIVATION), "hidden_activation": optional(HF_ACTIVATION),
    "rms_norm_eps": POSITIVE_REAL, "rope_theta": POSITIVE_REAL, "max_position_embeddings": POSITIVE,
    "tie_word_embeddings": FLAG, "attention_bias": optional(FLAG), "qkv_bias": optional(FLAG),
    "rope_scaling": optional(OBJECT), "rope_parameters": optional(OBJECT),
    "partial_rotary_factor": optional(POSITIVE_REAL),
    "sliding_window": optional(COUNT), "use_sliding_window": optional(FLAG), "layer_types": optional(NAMES),
    "sliding_window_pattern": optional(POSITIVE), "rope_local_base_freq": POSITIVE_REAL,
    "query_pre_attn_scalar": POSITIVE_REAL, "use_bidirectional_attention": optional(FLAG),
    "num_local_experts": optional(COUNT), "num_experts": optional(COUNT),
    "num_experts_per_tok": optional(POSITIVE), "moe_intermediate_size": optional(POSITIVE),
    "shared_expert_intermediate_size": optional(COUNT), "decoder_sparse_step": optional(POSITIVE),
    "mlp_only_layers": optional(INDICES), "norm_topk_prob": optional(FLAG),
    # what transformers itself checks when the tokenizer is loaded beside the config
    "bos_token_id": optional(TOKEN_IDS), "eos_token_id": optional(TOKEN_IDS), "pad_token_id": optional(COUNT),
    "architectures": optional(NAMES), "dtype": optional(TEXT), "torch_dtype": optional(TEXT),
    "attention_dropout": optional(REAL_AT_LEAST_0), "initializer_range": optional(REAL_AT_LEAST_0),
    "use_cache": FLAG, "mlp_bias": optional(FLAG), "pretraining_tp": optional(POSITIVE),
    "transformers_version": optional(TEXT),
}
HF_REQUIRED = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads")
ROPE_FIELDS: dict[str, Kind] = {  # inside rope_scaling / rope_parameters
    "rope_type": TEXT, "type": TEXT, "factor": POSITIVE_REAL, "rope_theta": POSITIVE_REAL,
    "low_freq_factor": POSITIVE_REAL, "high_freq_factor": POSITIVE_REAL,
    "original_max_position_embeddings": POSITIVE, "partial_rotary_factor": POSITIVE_REAL,
}
ROPE_NEEDS = {"linear": ("factor",),  # what each RoPE scaling type reads
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
LAYER_TYPES = ("sliding_attention", "full_attention")

# ---- GGUF metadata ({arch} is the file's general.architecture) -------------------------------------
GGUF_FIELDS: dict[str, Kind] = {
    "{arch}.block_count": POSITIVE, "{arch}.embedding_length": POSITIVE,
    "{arch}.feed_forward_length": POSITIVE, "{arch}.attention.head_count": POSITIVE,
    "{arch}.attention.head_count_kv": POSITIVE, "{arch}.context_length": POSITIVE,
    "{arch}.attention.layer_norm_rms_epsilon": POSITIVE_REAL, "{arch}.rope.freq_base": POSITIVE_REAL,
    "{arch}.vocab_size": POSITIVE, "{arch}.attention.key_length": POSITIVE,
    "{arch}.attention.sliding_window": COUNT, "{arch}.expert_count": COUNT,
    "{arch}.expert_used_count": POSITIVE, "{arch}.expert_feed_forward_length": POSITIVE,
    "{arch}.expert_shared_feed_forward_length": COUNT, "{arch}.expert_weights_norm": FLAG,
    "{arch}.rope.scaling.type": TEXT, "{arch}.rope.scaling.factor": POSITIVE_REAL,
}
GGUF_REQUIRED = ("{arch}.block_count", "{arch}.embedding_length", "{arch}.feed_forward_length",
                 "{arch}.attention.head_count",
                 "{arch}.context_length")

# ---- a manifest's model_config: ModelConfig's own fields -------------------------------------------
MANIFEST_RANGES: dict[str, Kind] = {  # beyond what each field's type says
    "vocab_size": POSITIVE, "hidden_size": POSITIVE, "intermediate_size": POSITIVE, "num_layers": POSITIVE,
    "num_heads": POSITIVE, "num_kv_heads": POSITIVE, "head_dim": POSITIVE, "rms_norm_eps": POSITIVE_REAL,
    "rope_theta": POSITIVE_REAL, "rope_scaling": optional(OBJECT), "max_position_embeddings": POSITIVE,
    "moe_layers": ("a list of MoE layer specs or nulls", lambda v: isinstance(v, list) and all(
        s is None or isinstance(s, Mapping) for s in v)),
    "sliding_window": COUNT, "layer_types": NAMES, "rope_local_theta": REAL_AT_LEAST_0,
    "embed_scale": POSITIVE_REAL, "norm_offset": REAL, "query_scale": REAL_AT_LEAST_0,
    "qk_norm_scope": ("'head' or 'all'", lambda v: v in ("head", "all")),
    "activation": (f"one of {', '.join(ACTIVATIONS)}", lambda v: v in ACTIVATIONS),
}
SPEC_RANGES: dict[str, Kind] = {  # an MoE layer spec's fields beyond their types
    "num_experts": POSITIVE, "top_k": POSITIVE, "expert_width": POSITIVE, "shared_width": COUNT,
    "router_neurons": POSITIVE, "sub_experts": COUNT, "sub_shared": COUNT, "sub_top_k": COUNT,
    "sub_router_neurons": POSITIVE, "num_prototypes": COUNT, "prototype_owner": OWNER,
    "routed_scaling": REAL, "router_jitter": REAL_AT_LEAST_0, "capacity_factor": REAL_AT_LEAST_0,
}
BY_TYPE: dict[str, Kind] = {"int": COUNT, "float": REAL, "bool": FLAG, "str": TEXT}


def fail(where, field: str, value, must: str):
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise ConfigFieldError(f"{where}: {field} is {shown}, but must be {must}: fix that field, or "
                           "use a complete, unedited copy of the model")


def _check(values: Mapping, table: Mapping[str, Kind], where, prefix: str = "") -> None:
    for field, (must, ok) in table.items():
        if field in values and not ok(values[field]):
            fail(where, prefix + field, values[field], must)


def _require(values: Mapping, names, where, what: str, prefix: str = "") -> None:
    for name in names:
        if values.get(name) is None:
            fail(where, prefix + name, values.get(name), f"given ({what} needs it)")


def check_model_type(value, where) -> None:
    """The first field read (it picks the family that reads the rest)."""
    if not isinstance(value, str):
        fail(where, "model_type", value, "a string naming the model's family")


def check_hf(get: Callable, where) -> None:
    """A Hugging Face config (`get(key)` reads it), before `ModelConfig.from_hf` builds from it."""
    values = {k: get(k) for k in HF_FIELDS if get(k, _ABSENT) is not _ABSENT}
    _require(values, HF_REQUIRED, where, "every model")
    _check(values, HF_FIELDS, where)
    for key in ("rope_scaling", "rope_parameters"):
        rope = values.get(key) or {}
        for sub in [rope, *[v for v in rope.values() if isinstance(v, Mapping)]]:  # Gemma: per layer type
            _check(sub, ROPE_FIELDS, where, f"{key}.")
        kind = rope.get("rope_type", rope.get("type"))
        _require(rope, ROPE_NEEDS.get(kind, ()), where, f"{key} of type {kind}", f"{key}.")
        if kind == "llama3" and \
                rope.get("high_freq_factor") == rope.get("low_freq_factor"):
            fail(where, f"{key}.high_freq_factor", rope.get("high_freq_factor"),
                  "unlike low_freq_factor (Llama-3 scaling divides by their difference)")
    heads, hidden, layers = values["num_attention_heads"], values["hidden_size"], values["num_hidden_layers"]
    if values.get("head_dim") is None and hidden % heads:
        fail(where, "hidden_size", hidden, f"a multiple of num_attention_heads ({heads}) when head_dim "
              "is not given")
    kv = values.get("num_key_value_heads") or heads
    if heads % kv:
        fail(where, "num_key_value_heads", kv, f"a divisor of num_attention_heads ({heads})")
    experts = values.get("num_experts") or values.get("num_local_experts")
    if experts and (values.get("num_experts_per_tok") or 0) > experts:
        fail(where, "num_experts_per_tok", values["num_experts_per_tok"], f"at most the {experts} experts")
    if any(i >= layers for i in values.get("mlp_only_layers") or ()):
        fail(where, "mlp_only_layers", values["mlp_only_layers"], f"layer numbers below {layers}")
    _check_layer_types(values.get("layer_types"), layers, where, "num_hidden_layers")


def _check_layer_types(types, layers: int, where, count_field: str) -> None:
    if types and (len(types) != layers or any(t not in LAYER_TYPES for t in types)):
        fail(where, "layer_types", types, f"one of {', '.join(LAYER_TYPES)} per layer ({count_field} "
              f"is {layers})")


_ABSENT = object()


def check_gguf(field: Callable, arch: str, where) -> None:
    """A GGUF file's metadata (`field(key, default)` reads it), before it becomes a config."""
    table = {k.format(arch=arch): kind for k, kind in GGUF_FIELDS.items()}
    values = {k: field(k) for k in table if field(k, _ABSENT) is not _ABSENT}
    _require(values, [k.format(arch=arch) for k in GGUF_REQUIRED], where, "a GGUF model", "GGUF metadata ")
    _check(values, table, where, "GGUF metadata ")
    if values.get(f"{arch}.vocab_size") is None:  # then the vocabulary is counted from the tokens
        tokens = field("tokenizer.ggml.tokens")
        if not (NAMES[1](tokens) and tokens):
            fail(where, "GGUF metadata tokenizer.ggml.tokens", tokens,
                  f"a list of strings ({arch}.vocab_size is not given)")


def check_manifest_config(d: Mapping, where, fields, spec_fields) -> None:
    """A manifest's `model_config` (`fields`: ModelConfig's dataclass fields; `spec_fields`:
    FFNSpec's), before `ModelConfig.from_dict` builds from it."""
    if not isinstance(d, Mapping):
        fail(where, "model_config", d, "an object")
    _check_dataclass(d, fields, MANIFEST_RANGES, where, "model_config.")
    for i, spec in enumerate(d.get("moe_layers") or ()):
        if spec is not None:
            check_spec(spec, where, f"model_config.moe_layers[{i}].", spec_fields)
    if d.get("moe_layers") and len(d["moe_layers"]) != d["num_layers"]:
        fail(where, "model_config.moe_layers", f"{len(d['moe_layers'])} layers",
              f"one entry per layer ({d['num_layers']})")
    if d["num_heads"] % d["num_kv_heads"]:
        fail(where, "model_config.num_kv_heads", d["num_kv_heads"], f"a divisor of num_heads ({d['num_heads']})")
    _check_layer_types(d.get("layer_types"), d["num_layers"], where, "num_layers")


def check_spec(spec: Mapping, where, prefix: str, spec_fields) -> None:
    """One MoE layer's spec (`FFNSpec`'s fields), its top-k within its experts."""
    _check_dataclass(spec, spec_fields, SPEC_RANGES, where, prefix)
    if spec["top_k"] > spec["num_experts"]:
        fail(where, f"{prefix}top_k", spec["top_k"], f"at most num_experts ({spec['num_experts']})")


def _check_dataclass(d: Mapping, fields, ranges: Mapping[str, Kind], where, prefix: str) -> None:
    """Every key a field of the dataclass, every field without a default given, each value of
    its field's type (and range, from `ranges`)."""
    known = {f.name: f for f in fields}
    for key in d:
        if key not in known:
            fail(where, prefix + str(key), d[key], f"absent (no such field; known: {', '.join(known)})")
    for name, f in known.items():
        if name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                fail(where, prefix + name, None, "given")
            continue
        must, ok = ranges.get(name) or BY_TYPE.get(str(f.type), ("", lambda v: True))
        if not ok(d[name]):
            fail(where, prefix + name, d[name], must)

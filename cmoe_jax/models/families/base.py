"""What a model family is: everything that differs between decoder families, in one place.

A `Family` says how to read its Hugging Face config (`parse`: the `ModelConfig` fields it
sets beyond the shared ones), how to write one back (`export`), its tensor names in
`transformers` checkpoints, in exports and in llama.cpp's GGUF files, and which
`transformers` class (or remote-code class, for carved models) runs it. Loading and export
read every tensor name from the family (`attention`, `dense_mlp`, `shared_expert`, `experts`
under `moe_prefix`, `norms`), and a family that stores several weights in one tensor
(Phi-3's `qkv_proj`, `gate_up_proj`) declares it as `Fused`. The decoder itself
is generic: it reads switches (`activation`, `sliding_window`, `norm_offset`, ...) that the
family's `parse` sets, so a new family is one new unit in this package plus its tests
(docs/guides/adding-a-family.md).
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Callable, Mapping

# our decoder-layer norm -> transformers' name (pre-norm layout: two norms a layer)
PRE_NORMS = MappingProxyType({"input_norm": "input_layernorm",
                              "post_attn_norm": "post_attention_layernorm"})
ATTENTION = MappingProxyType({"q_proj": "q_proj.weight", "k_proj": "k_proj.weight",
                              "v_proj": "v_proj.weight", "o_proj": "o_proj.weight",
                              "q_bias": "q_proj.bias", "k_bias": "k_proj.bias",
                              "v_bias": "v_proj.bias"})
DENSE_MLP = MappingProxyType({"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
# a shared expert beside the routed ones (Qwen2-MoE), our MoEFFN names -> transformers'
SHARED_EXPERT = MappingProxyType({"shared_gate": "shared_expert.gate_proj",
                                  "shared_up": "shared_expert.up_proj",
                                  "shared_down": "shared_expert.down_proj",
                                  "shared_gate_kernel": "shared_expert_gate"})
EXPERTS = MappingProxyType({"expert_gate": "gate_proj", "expert_up": "up_proj",
                            "expert_down": "down_proj"})
# llama.cpp's per-layer tensor names (blk.N.<name>.weight) -> transformers' module names
GGUF_LAYER = MappingProxyType({
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj"})
# llama.cpp's MoE tensors: the router and the experts stacked per layer ([n_expert, out, in]),
# named as transformers' stacked (unfused) expert tensors
GGUF_EXPERTS = MappingProxyType({
    **GGUF_LAYER, "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"})
# Qwen2-MoE's shared expert and its sigmoid gate (`ffn_gate_inp_shexp`, [1, d] or [d])
GGUF_SHARED_EXPERT = MappingProxyType({
    **GGUF_EXPERTS, "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate"})

Get = Callable[..., Any]  # get(key, default=None) over a config object or config.json dict


@dataclasses.dataclass(frozen=True)
class Fused:
    """One checkpoint tensor holding several of a layer's projections stacked on its output
    rows (`[sum of rows, in]`): loading splits it, export concatenates the parts again.
    `name` and `parts` are relative to `model.layers.N.`; `rows(cfg)` gives each part's rows
    from the `ModelConfig`."""

    name: str
    parts: tuple[str, ...]
    rows: Callable[[Any], tuple[int, ...]]


def _nothing(*_args) -> dict:
    return {}


def gguf_experts(arch: str, field, norm_topk_prob: bool, experts: str = "num_experts",
                 width: str | None = "moe_intermediate_size") -> dict:
    """The MoE fields of a llama.cpp `arch` GGUF under the family's config names: expert
    count, experts per token, expert width (`{arch}.expert_feed_forward_length`, where the
    family has a field for it) and whether the top-k gates are renormalised, which llama.cpp
    fixes per architecture unless the file says (`{arch}.expert_weights_norm`)."""
    out = {experts: field(f"{arch}.expert_count"),
           "num_experts_per_tok": field(f"{arch}.expert_used_count"),
           "norm_topk_prob": bool(field(f"{arch}.expert_weights_norm", norm_topk_prob))}
    if width is not None:
        out[width] = field(f"{arch}.expert_feed_forward_length")
    return out


@dataclasses.dataclass(frozen=True)
class Family:
    """One decoder family (a `model_type` of `transformers`)."""

    model_type: str
    architecture: str  # the transformers class of the family's own form
    parse: Callable[[Get], dict] = _nothing  # ModelConfig fields beyond the shared ones
    export: Callable[[Any], dict] = _nothing  # config.json fields beyond the shared ones
    export_drops: tuple[str, ...] = ()  # shared config.json fields the family does not have
    remote: str | None = None  # remote-code class prefix of its carved / compressed MoE forms
    # tensor names: our module or leaf -> transformers' (under model.layers.N.)
    norms: Mapping[str, str] = dataclasses.field(default_factory=lambda: PRE_NORMS)
    attention: Mapping[str, str] = dataclasses.field(default_factory=lambda: ATTENTION)  # under self_attn.
    dense_mlp: Mapping[str, str] = dataclasses.field(default_factory=lambda: DENSE_MLP)  # under mlp.
    shared_expert: Mapping[str, str] = dataclasses.field(default_factory=lambda: SHARED_EXPERT)
    moe_prefix: str = "mlp"  # transformers' module holding the MoE block
    experts: Mapping[str, str] = dataclasses.field(default_factory=lambda: EXPERTS)  # one expert's
    fused: tuple[Fused, ...] = ()  # tensors that hold several of the names above
    # whether a config's MoE layers are still this family's own (export in its own class)
    own_moe: Callable[[Any, list], bool] = lambda cfg, specs: not specs
    gguf_arch: str | None = None  # llama.cpp's architecture name, when it writes the family
    gguf_moe: bool = False  # told apart from a family of the same arch by its expert tensors
    gguf_layer: Mapping[str, str] = dataclasses.field(default_factory=lambda: GGUF_LAYER)
    gguf_permute_qk: bool = False  # llama.cpp permutes q/k rows (llama) for its RoPE
    gguf_norm_shift: float = 0.0  # llama.cpp stores norm weights plus this (Gemma: 1)
    gguf_config: Callable[[Callable], dict] = _nothing  # config fields only the GGUF says
    bos_per_window: bool = False  # evaluation windows each start with BOS (lm-eval's add_bos_token)

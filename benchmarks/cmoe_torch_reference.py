"""The CMoE authors' way of running a converted model, in torch: the reference side of
`benchmarks/train_step.py --model converted`.

Written from the description of JarvisPei/CMoE `CMoE_model.py` (not copied): each MoE layer
is a shared SwiGLU MLP plus a `ModuleList` of routed SwiGLU experts, and the forward pass
loops over the experts in Python, picking each one's tokens with `torch.where` and
`index_select` and adding its gated output back with `index_add`. The router is the
analytical one: the experts' representative neurons score a token with
`|silu(x W_gate^R) * (x W_up^R)|` (here r neurons per expert, summed, as in
`cmoe_jax.moe.routers.cmoe_scores`; the authors use one), a softmax over experts, selection by
`top_k(p + b)` with the balancing bias `b` (moved by +-speed after each training forward,
never trained) and gate weights `1 + p * u` with the trainable scales `u`. With the weights of
a cmoe_jax converted model it computes the same function as `cmoe_jax.moe.MoEFFN`.

`reference_llama(model)` builds a `transformers` Llama from a cmoe_jax `Decoder` (dense or
converted, Llama architecture) with these MoE layers in place of the converted FFNs;
`copy_lora_factors` gives peft's adapters the same initial A (and B = 0) as cmoe_jax's.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def _t(array) -> torch.Tensor:
    return torch.from_numpy(np.array(array, dtype=np.float32))


class SwiGLUExpert(nn.Module):
    """One expert (or the shared MLP): `down(silu(gate(x)) * up(x))`, Llama's MLP names."""

    def __init__(self, d_model: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, width, bias=False)
        self.up_proj = nn.Linear(d_model, width, bias=False)
        self.down_proj = nn.Linear(width, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RepresentativeNeuronRouter(nn.Module):
    """Expert ids `[T, k]` and gate weights `[T, k]` from each expert's r representative
    neurons. `gate`/`classifier` hold the neurons' gate and up rows (expert-major, the
    authors' names); `extra_scale` is u, the buffer `extra_bias` is b."""

    def __init__(self, d_model: int, num_experts: int, neurons: int, top_k: int, bias_speed: float):
        super().__init__()
        self.num_experts, self.neurons, self.top_k = num_experts, neurons, top_k
        self.bias_speed = bias_speed
        self.gate = nn.Linear(d_model, num_experts * neurons, bias=False)
        self.classifier = nn.Linear(d_model, num_experts * neurons, bias=False)
        self.extra_scale = nn.Parameter(torch.zeros(num_experts))
        self.register_buffer("extra_bias", torch.zeros(num_experts), persistent=False)

    def forward(self, x):
        h = (self.classifier(x) * F.silu(self.gate(x))).abs()
        scores = h.view(-1, self.num_experts, self.neurons).sum(-1)
        probs = scores.softmax(dim=-1, dtype=torch.float32)
        ids = torch.topk(probs + self.extra_bias, self.top_k, dim=-1).indices
        weights = (1.0 + probs * self.extra_scale).gather(1, ids)
        return weights.to(x.dtype), ids

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """Underloaded experts' bias up by the speed, overloaded ones' down (sec. 3.3)."""
        load = counts.float()
        self.extra_bias += self.bias_speed * torch.sign(load.mean() - load)


class ReferenceMoE(nn.Module):
    """Shared MLP + routed experts run one by one in a Python loop (the authors' MoE).

    `run_routed = False` skips the routed experts (router and shared MLP still run): what a
    step costs without them (`benchmarks/routed_share.py`)."""

    run_routed = True

    def __init__(self, d_model: int, expert_width: int, num_experts: int, top_k: int,
                 shared_width: int, neurons: int, bias_speed: float):
        super().__init__()
        self.d_model = d_model
        self.gate = RepresentativeNeuronRouter(d_model, num_experts, neurons, top_k, bias_speed)
        self.experts = nn.ModuleList(SwiGLUExpert(d_model, expert_width) for _ in range(num_experts))
        self.shared_experts = SwiGLUExpert(d_model, shared_width) if shared_width else None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, self.d_model)
        weights, ids = self.gate(x)
        counts = torch.bincount(ids.flatten(), minlength=len(self.experts))
        if self.training:  # balancing step from this batch's loads, as the authors do
            self.gate.update_bias(counts)
        y = torch.zeros_like(x)
        for e, n in enumerate(counts.tolist()):
            if n == 0 or not self.run_routed:
                continue
            rows, slot = torch.where(ids == e)
            out = self.experts[e](x.index_select(0, rows)) * weights[rows, slot].unsqueeze(-1)
            y = y.index_add(0, rows, out)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(shape)


def _load_moe(mlp, bias_speed: float) -> ReferenceMoE:
    """A `ReferenceMoE` holding the weights of a cmoe_jax `MoEFFN` with the cmoe router."""
    gate, up, down = (np.asarray(getattr(mlp, "expert_" + n)[...]) for n in ("gate", "up", "down"))
    moe = ReferenceMoE(mlp.d_model, mlp.expert_width, mlp.num_experts, mlp.top_k,
                       mlp.shared_width, mlp.spec.router_neurons, bias_speed)
    with torch.no_grad():
        for e, expert in enumerate(moe.experts):
            expert.gate_proj.weight.copy_(_t(gate[e].T))
            expert.up_proj.weight.copy_(_t(up[e].T))
            expert.down_proj.weight.copy_(_t(down[e].T))
        if moe.shared_experts is not None:
            for name in ("gate", "up", "down"):
                w = getattr(mlp, "shared_" + name)[...]
                getattr(moe.shared_experts, name + "_proj").weight.copy_(_t(np.asarray(w).T))
        moe.gate.gate.weight.copy_(_t(np.asarray(mlp.router_gate[...]).T))
        moe.gate.classifier.weight.copy_(_t(np.asarray(mlp.router_up[...]).T))
        moe.gate.extra_scale.copy_(_t(mlp.u[...]))
        moe.gate.extra_bias.copy_(_t(mlp.router_bias[...]))
    return moe


def _llama_config(cfg):
    import transformers

    if cfg.model_type != "llama" or cfg.attention_bias or cfg.qk_norm:
        raise SystemExit(f"error: the torch reference covers Llama-architecture models only, this "
                         f"one is {cfg.model_type!r}: convert a Llama model (e.g. smollm2)")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, **dict(cfg.rope_scaling or ())}
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_parameters=rope,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings)


def reference_llama(model, bias_speed: float = 1e-3):
    """float32 `LlamaForCausalLM` (SDPA attention) with the weights of cmoe_jax `Decoder`
    `model`; its CMoE layers become `ReferenceMoE`s, its dense FFNs stay Llama MLPs."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = model.config
    ref = transformers.LlamaForCausalLM._from_config(_llama_config(cfg), attn_implementation="sdpa",
                                                     dtype=torch.float32)
    state = {"model.embed_tokens.weight": _t(model.embed[...]),
             "model.norm.weight": _t(model.norm.weight[...])}
    state["lm_head.weight"] = (state["model.embed_tokens.weight"] if cfg.tie_word_embeddings
                               else _t(np.asarray(model.lm_head[...]).T))
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        state[pre + "input_layernorm.weight"] = _t(layer.input_norm.weight[...])
        state[pre + "post_attention_layernorm.weight"] = _t(layer.post_attn_norm.weight[...])
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[pre + f"self_attn.{name}.weight"] = _t(np.asarray(getattr(layer.attn, name)[...]).T)
        if getattr(layer.mlp, "router", None) == "cmoe":
            ref.model.layers[i].mlp = _load_moe(layer.mlp, bias_speed)
            state.update({pre + "mlp." + k: v for k, v in ref.model.layers[i].mlp.state_dict().items()})
        else:
            for name in ("gate", "up", "down"):
                state[pre + f"mlp.{name}_proj.weight"] = _t(np.asarray(getattr(layer.mlp, name)[...]).T)
    ref.load_state_dict(state, strict=True)
    return ref


# cmoe_jax weight name -> the torch module path under a decoder layer (experts: "{e}")
_MODULES = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
            "o_proj": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
            "down": "mlp.down_proj", "shared_gate": "mlp.shared_experts.gate_proj",
            "shared_up": "mlp.shared_experts.up_proj", "shared_down": "mlp.shared_experts.down_proj",
            "expert_gate": "mlp.experts.{e}.gate_proj", "expert_up": "mlp.experts.{e}.up_proj",
            "expert_down": "mlp.experts.{e}.down_proj"}


def copy_lora_factors(peft_model, adapters: dict) -> int:
    """Set peft's `lora_A`/`lora_B` of every adapted weight to cmoe_jax's A/B (`[in, r]`,
    `[r, out]`, experts stacked on a leading axis), so both sides train the same adapters.
    Returns how many peft layers were set; raises if one of them does not exist."""
    layers = peft_model.get_base_model().model.layers
    done = 0
    with torch.no_grad():
        for i, groups in adapters["layers"].items():
            for weights in groups.values():
                for name, ab in weights.items():
                    a, b = np.asarray(ab["a"]), np.asarray(ab["b"])
                    stacked = a.ndim == 3
                    for e in range(a.shape[0] if stacked else 1):
                        target = layers[int(i)].get_submodule(_MODULES[name].format(e=e))
                        target.lora_A["default"].weight.copy_(_t((a[e] if stacked else a).T))
                        target.lora_B["default"].weight.copy_(_t((b[e] if stacked else b).T))
                        done += 1
    return done

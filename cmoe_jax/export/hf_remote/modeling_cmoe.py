"""transformers model code for MoE models exported by `python -m cmoe_jax.export --format hf`.

Copied beside the weights of an exported model and loaded with
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`. The decoder is the base
family's own (Llama, Mistral, Qwen2, Qwen3, Gemma 3); only the FFN of each MoE layer is replaced by `MoEMLP`,
which computes what `cmoe_jax.moe.MoEFFN` computes (same parameter names and layouts:
`[in, out]` matrices, routed experts stacked on a leading axis). This file is not imported
by cmoe_jax itself, which never needs torch.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)
from transformers.activations import ACT2FN


class MoEMLP(nn.Module):
    """`shared(x) + sum over the top-k routed experts of gate * expert(x)`; routers:

    Every GLU uses the family's activation `act` (SiLU, or Gemma's GELU-tanh).

    - "cmoe": scores = |act(x R_gate) * (x R_up)| summed over each expert's r neurons,
      p = softmax(scores); experts = top-k of p + bias; gate = 1 + p * u.
    - "linear": softmax(x W_r), top-k probabilities (renormalised when norm_topk_prob).
    - "sum": every expert, gate 1.
    Routing runs in float32; experts run one at a time on the tokens that chose them.
    """

    def __init__(self, hidden_size, num_experts, top_k, expert_width, shared_width=0,
                 router="cmoe", norm_topk_prob=False, router_neurons=1, act="silu", **_):
        super().__init__()
        self.act = ACT2FN[act]
        d, m, e, s = hidden_size, expert_width, num_experts, shared_width
        self.num_experts, self.top_k, self.router = e, top_k, router
        self.norm_topk_prob = norm_topk_prob
        new = lambda *shape: nn.Parameter(torch.zeros(*shape))
        self.shared_width = s
        if s:
            self.shared_gate, self.shared_up, self.shared_down = new(d, s), new(d, s), new(s, d)
        self.expert_gate, self.expert_up, self.expert_down = new(e, d, m), new(e, d, m), new(e, m, d)
        if router == "cmoe":
            self.router_gate, self.router_up = new(d, e * router_neurons), new(d, e * router_neurons)
            self.u = new(e)
            self.router_bias = nn.Parameter(torch.zeros(e), requires_grad=False)
        elif router == "linear":
            self.router_kernel = new(d, e)

    def route(self, x):
        """(expert ids [T, k], float32 gates [T, k])."""
        x = x.float()
        if self.router == "sum":
            ids = torch.arange(self.num_experts, device=x.device).expand(x.shape[0], -1)
            return ids, torch.ones(ids.shape, device=x.device)
        if self.router == "linear":
            probs = torch.softmax(x @ self.router_kernel.float(), dim=-1)
            gates, ids = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk_prob:
                gates = gates / gates.sum(-1, keepdim=True)
            return ids, gates
        h = torch.abs(self.act(x @ self.router_gate.float()) * (x @ self.router_up.float()))
        probs = torch.softmax(h.reshape(x.shape[0], self.num_experts, -1).sum(-1), dim=-1)
        ids = torch.topk(probs + self.router_bias.float(), self.top_k, dim=-1).indices
        return ids, 1.0 + probs.gather(-1, ids) * self.u.float()[ids]

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids, gates = self.route(x)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if self.shared_width:
            h = self.act(x @ self.shared_gate) * (x @ self.shared_up)
            out += (h @ self.shared_down).float()
        for e in range(self.num_experts):
            tokens, slot = torch.nonzero(ids == e, as_tuple=True)
            if tokens.numel():
                xe = x[tokens]
                h = self.act(xe @ self.expert_gate[e]) * (xe @ self.expert_up[e])
                out.index_add_(0, tokens, (h @ self.expert_down[e]).float() * gates[tokens, slot, None])
        return out.to(x.dtype).reshape(shape)


def _install_moe(model, config):
    act = getattr(config, "hidden_activation", None) or config.hidden_act
    for i, spec in enumerate(config.moe_layers or []):
        if spec:
            model.model.layers[i].mlp = MoEMLP(config.hidden_size, **spec, act=act)


class _WithMoE:
    """The base family's causal LM with `MoEMLP` in the layers `config.moe_layers` names."""

    def __init__(self, config):
        super().__init__(config)
        _install_moe(self, config)


def _family(name: str, model_type: str, config_base, model_base):
    """(`Cmoe<name>Config`, `Cmoe<name>ForCausalLM`): the family's config with `moe_layers`
    (per layer: None for a dense FFN, or `MoEMLP`'s arguments) and its causal LM with them."""
    config = type(f"Cmoe{name}Config", (config_base,),
                  {"model_type": model_type, "moe_layers": None,
                   "__annotations__": {"moe_layers": "list | None"}})
    model = type(f"Cmoe{name}ForCausalLM", (_WithMoE, model_base), {"config_class": config})
    return config, model


# the names `auto_map` in an exported config.json points at
CmoeLlamaConfig, CmoeLlamaForCausalLM = _family("Llama", "cmoe_llama", LlamaConfig, LlamaForCausalLM)
CmoeMistralConfig, CmoeMistralForCausalLM = _family("Mistral", "cmoe_mistral", MistralConfig,
                                                    MistralForCausalLM)
CmoeGemma3Config, CmoeGemma3ForCausalLM = _family("Gemma3", "cmoe_gemma3_text", Gemma3TextConfig,
                                                  Gemma3ForCausalLM)
CmoeQwen2Config, CmoeQwen2ForCausalLM = _family("Qwen2", "cmoe_qwen2", Qwen2Config, Qwen2ForCausalLM)
CmoeQwen3Config, CmoeQwen3ForCausalLM = _family("Qwen3", "cmoe_qwen3", Qwen3Config, Qwen3ForCausalLM)

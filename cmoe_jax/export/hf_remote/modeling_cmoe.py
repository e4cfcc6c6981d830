"""transformers model code for MoE models exported by `python -m cmoe_jax.export --format hf`.

Copied beside the weights of an exported model and loaded with
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`. The decoder is the base
family's own (Llama, Mistral, Qwen2, Qwen3, Gemma 3, and the MoE families Qwen2-MoE,
Qwen3-MoE, OLMoE, Mixtral); only the FFN of each MoE layer is replaced by `MoEMLP`, which
computes what `cmoe_jax.moe.MoEFFN` / `HierMoEFFN` compute (same parameter names and
layouts: `[in, out]` matrices, routed experts stacked on a leading axis). This file is not
imported by cmoe_jax itself, which never needs torch.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM,
                          OlmoeConfig, OlmoeForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)
from transformers.activations import ACT2FN

NEG = float("-inf")
# router kind -> its torch routing `f(torch, act, x, p, k, norm, keep) -> (ids, gates)`: the
# export writes each router's function (`cmoe_jax.moe.routers`) at the end of this file
ROUTES = {}


def to_prototypes(ids, gates, slot_map, rule):
    """ConMoE: chosen slots -> stored prototypes (-1: pruned, weight 0); a token's gates on
    slots sharing a prototype merged onto the first of them by `rule` (sum, max, renorm)."""
    proto = slot_map.long()[ids]
    valid = proto >= 0
    gates = torch.where(valid, gates, torch.zeros_like(gates))
    proto = proto.clamp(min=0)
    same = (proto[:, :, None] == proto[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    earlier = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).tril(-1)
    first = valid & ~(same & earlier).any(-1)
    if rule == "sum":
        merged = torch.einsum("tij,tj->ti", same.float(), gates)
    else:
        merged = torch.where(same, gates[:, None, :], torch.full_like(same, NEG, dtype=gates.dtype)).amax(-1)
        merged = torch.where(first, merged, torch.zeros_like(merged))
        if rule == "renorm":
            kept, total = merged.sum(-1, keepdim=True), gates.sum(-1, keepdim=True)
            merged = merged * torch.where(kept != 0, total / torch.where(kept != 0, kept, 1.0), 1.0)
    return proto, torch.where(first, merged, torch.zeros_like(merged))


class MoEMLP(nn.Module):
    """`shared(x) [* sigmoid(x W_sg)] + sum over the chosen experts of gate * expert(x)`.

    Routers as in `cmoe_jax.moe.routers` (their functions in `ROUTES`); every GLU uses
    the family's activation `act`. ConMoE (`num_prototypes` K): the router keeps its slots,
    `slot_map` sends them to the K stored experts (`to_prototypes`); a layer of a cross-layer
    scope reads its `owner`'s table. Hierarchical CMoE (`sub_experts` N'): each chosen expert
    runs its `sub_shared` sub-experts and the `sub_top_k` its sub-router picks (scores summed
    over `sub_router_neurons`, gates 1 + s' u). Routing runs in float32; experts run one at a
    time on the tokens that chose them.
    """

    # the `moe_layers` entry's keys this module implements (cmoe_jax's `FFNSpec` fields)
    SPEC = ("num_experts", "top_k", "expert_width", "shared_width", "router", "norm_topk_prob",
            "router_neurons", "sub_experts", "sub_shared", "sub_top_k", "sub_router_neurons",
            "num_prototypes", "prototype_owner", "duplicate_gates", "shared_gated", "router_balance",
            "router_scoring", "routed_scaling", "router_jitter", "skip_compensation", "threshold_routing",
            "router_params")

    def __init__(self, hidden_size, spec, *, act, owner=None):
        """`spec`: the layer's `moe_layers` entry (every key of `SPEC`), taken whole."""
        super().__init__()
        unknown = sorted(set(spec) - set(self.SPEC))
        if unknown:
            raise ValueError(f"moe_layers entry with {unknown}: this modeling_cmoe.py does not implement them")
        self.act = ACT2FN[act]
        d, m, n, s = hidden_size, spec["expert_width"], spec["num_experts"], spec["shared_width"]
        sub_experts, sub_shared, num_prototypes = spec["sub_experts"], spec["sub_shared"], spec["num_prototypes"]
        self.num_experts, self.top_k, self.router = n, spec["top_k"], spec["router"]
        self.norm_topk_prob, self.sub_top_k = spec["norm_topk_prob"], spec["sub_top_k"]
        # the linear router's scoring and gate scale (jitter only acts in training)
        self.scoring, self.scaling = spec["router_scoring"], spec["routed_scaling"]
        self.sub_experts, self.sub_shared = sub_experts, sub_shared
        self.num_prototypes, self.duplicate_gates = num_prototypes, spec["duplicate_gates"]
        self.shared_width, self.shared_gated = s, spec["shared_gated"] and s > 0
        self._owner = [owner] if owner is not None else []  # a list: not a submodule
        new = lambda *shape: nn.Parameter(torch.zeros(*shape))
        fixed = lambda *shape: nn.Parameter(torch.zeros(*shape), requires_grad=False)
        if s:
            self.shared_gate, self.shared_up, self.shared_down = new(d, s), new(d, s), new(s, d)
        if self.shared_gated:
            self.shared_gate_kernel = new(d, 1)
        if num_prototypes:
            self.register_buffer("slot_map", torch.zeros(n, dtype=torch.int32))
        units = num_prototypes or n  # stored experts (hierarchical: expert families)
        rows = units * max(sub_experts, 1)
        if owner is None:
            self.expert_gate, self.expert_up = new(rows, d, m), new(rows, d, m)
            self.expert_down = new(rows, m, d)
        # the (top-level) router's arrays: role -> [name, shape, init] (`RouterParam`)
        router_params = spec["router_params"]
        self.router_params = {role: name for role, (name, _, _) in router_params.items()}
        for name, shape, init in router_params.values():
            setattr(self, name, (fixed if init in ("bias", "fixed") else new)(*shape))
        self.skip_compensation = spec["skip_compensation"]
        if self.skip_compensation:  # the skipped experts' predicted outputs, from the router's h
            self.skip_down = new(n * spec["router_neurons"], d)
        if sub_experts:
            routed = sub_experts - sub_shared
            if owner is None:
                self.sub_gate = new(units, d, routed * spec["sub_router_neurons"])
                self.sub_up = new(units, d, routed * spec["sub_router_neurons"])
            self.u, self.router_bias = new(units, routed), fixed(units, routed)

    def table(self, name):
        """A stored-expert tensor: this layer's, or its scope owner's."""
        return getattr(self._owner[0] if self._owner else self, name)

    def top_route(self, x, keep):
        """The top-level choice over the router's slots: (ids [T, k], float32 gates [T, k])."""
        p = {role: getattr(self, name) for role, name in self.router_params.items()}
        r = {"top_k": self.top_k, "norm_topk_prob": self.norm_topk_prob, "scoring": self.scoring,
             "scaling": self.scaling}
        return ROUTES[self.router](torch, self.act, x, p, r, keep)

    def route(self, x):
        """(the router's slots [T, k], expert rows [T, j], float32 gates [T, j]) of tokens x [T, d]."""
        x = x.float()
        keep = self.slot_map >= 0 if self.num_prototypes else None
        slots, gates = self.top_route(x, keep)
        ids = slots
        if self.num_prototypes:
            ids, gates = to_prototypes(slots, gates, self.slot_map, self.duplicate_gates)
        return (slots,) + (self.sub_route(x, ids, gates) if self.sub_experts else (ids, gates))

    def skipped(self, x, slots):
        """The experts outside `slots` predicted from their router neurons' h: (h, 0 on the chosen
        experts' columns) @ skip_down, float32 [T, d]."""
        gate, up = (getattr(self, self.router_params[role]).float() for role in ("gate", "up"))
        h = self.act(x @ gate) * (x @ up)
        # one column more for the dropped pairs' id E (threshold routing), then cut off
        chosen = torch.zeros(x.shape[0], self.num_experts + 1, dtype=torch.bool, device=x.device)
        chosen.scatter_(1, slots.long(), True)
        chosen = chosen[:, :self.num_experts]
        h = h.masked_fill(chosen.repeat_interleave(h.shape[1] // self.num_experts, dim=1), 0.0)
        return h @ self.skip_down.float()

    def sub_route(self, x, top_ids, top_w):
        """Each chosen expert's shared sub-experts and the top `sub_top_k` of its sub-router."""
        gate, up = self.table("sub_gate"), self.table("sub_up")
        (t, k), routed = top_ids.shape, self.u.shape[1]
        h = torch.zeros(t, k, gate.shape[-1], device=x.device)
        for e in range(gate.shape[0]):
            rows, slot = torch.nonzero(top_ids == e, as_tuple=True)
            if rows.numel():
                h[rows, slot] = self.act(x[rows] @ gate[e].float()) * (x[rows] @ up[e].float())
        probs = torch.softmax(torch.abs(h).reshape(t, k, routed, -1).sum(-1), dim=-1)
        picked = torch.topk(probs + self.router_bias.float()[top_ids], self.sub_top_k, dim=-1).indices
        g = 1.0 + probs.gather(-1, picked) * self.u.float()[top_ids[..., None], picked]
        base = top_ids[..., None] * self.sub_experts
        shared = base + torch.arange(self.sub_shared, device=x.device)
        ids = torch.cat([shared, base + self.sub_shared + picked], dim=-1)
        w = top_w[..., None]
        return ids.reshape(t, -1), torch.cat([w.expand(shared.shape), w * g], dim=-1).reshape(t, -1)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        slots, ids, gates = self.route(x)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if self.skip_compensation:
            out += self.skipped(x.float(), slots)
        if self.shared_width:
            h = self.act(x @ self.shared_gate) * (x @ self.shared_up)
            shared = h @ self.shared_down
            if self.shared_gated:
                shared = shared * torch.sigmoid(x @ self.shared_gate_kernel)
            out += shared.float()
        wg, wu, wd = self.table("expert_gate"), self.table("expert_up"), self.table("expert_down")
        for e in range(wg.shape[0]):
            tokens, slot = torch.nonzero(ids == e, as_tuple=True)
            if tokens.numel():
                xe = x[tokens]
                h = self.act(xe @ wg[e]) * (xe @ wu[e])
                out.index_add_(0, tokens, (h @ wd[e]).float() * gates[tokens, slot, None])
        return out.to(x.dtype).reshape(shape)


def _install_moe(model, config):
    act = getattr(config, "hidden_activation", None) or config.hidden_act
    layers = model.model.layers
    for i, spec in enumerate(config.moe_layers or []):
        if spec:
            owner = spec.get("prototype_owner", -1)
            owner = layers[owner].mlp if owner >= 0 and owner != i else None
            layers[i].mlp = MoEMLP(config.hidden_size, spec, act=act, owner=owner)


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


# the names `auto_map` in an exported config.json points at: Cmoe<name>Config, Cmoe<name>ForCausalLM
_FAMILIES = (("Llama", "cmoe_llama", LlamaConfig, LlamaForCausalLM),
             ("Mistral", "cmoe_mistral", MistralConfig, MistralForCausalLM),
             ("Gemma3", "cmoe_gemma3_text", Gemma3TextConfig, Gemma3ForCausalLM),
             ("Phi3", "cmoe_phi3", Phi3Config, Phi3ForCausalLM),
             ("Qwen2", "cmoe_qwen2", Qwen2Config, Qwen2ForCausalLM),
             ("Qwen3", "cmoe_qwen3", Qwen3Config, Qwen3ForCausalLM),
             ("Qwen2Moe", "cmoe_qwen2_moe", Qwen2MoeConfig, Qwen2MoeForCausalLM),
             ("Qwen3Moe", "cmoe_qwen3_moe", Qwen3MoeConfig, Qwen3MoeForCausalLM),
             ("Olmoe", "cmoe_olmoe", OlmoeConfig, OlmoeForCausalLM),
             ("Mixtral", "cmoe_mixtral", MixtralConfig, MixtralForCausalLM))
for _name, _model_type, _config_base, _model_base in _FAMILIES:
    globals()[f"Cmoe{_name}Config"], globals()[f"Cmoe{_name}ForCausalLM"] = _family(
        _name, _model_type, _config_base, _model_base)

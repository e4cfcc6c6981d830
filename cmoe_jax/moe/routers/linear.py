"""The "linear" router (Qwen3-MoE, Mixtral, ExpertWeaver): softmax over all experts of
`x @ W_r`, the top-k probabilities as gates, optionally renormalised to sum 1 (Mixtral).

Options, each off by default: `router_balance`, the choice is the top-k of `probs + b`, b
`[E]` a balancing bias that `MoEFFN.update_bias` moves towards equal loads (aux-loss-free
balancing, DeepSeek-V3); the gates stay the chosen experts' probabilities, so b steers which
experts run, not how much they count, and gets no gradient. `router_scoring="sigmoid"`:
each expert's score is `sigmoid(x W_r)` instead of the softmax (DeepSeek-V3).
`routed_scaling`: the gates times this factor, after any renormalisation. `router_jitter`
acts on the router's input, in the layer."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cmoe_jax.moe.routers.base import Router, RouterParam, Routing


def masked_logits(x, kernel, keep=None):
    """float32 `x @ W_r`, -inf for the experts not kept."""
    logits = jnp.dot(x.astype(jnp.float32), kernel.astype(jnp.float32))
    return logits if keep is None else jnp.where(keep, logits, -jnp.inf)


def linear_route(x, kernel, routing: Routing, keep=None, bias=None):
    """`keep` (bool `[E]`, optional): experts not kept get logit -inf (pruned); `bias` (`[E]`,
    optional): the balancing bias added for the choice only."""
    top_k, logits = routing.top_k, masked_logits(x, kernel, keep)
    probs = jax.nn.sigmoid(logits) if routing.scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    if bias is None:
        gates, ids = jax.lax.top_k(probs, top_k)
    else:
        key = probs + jax.lax.stop_gradient(bias.astype(jnp.float32))
        _, ids = jax.lax.top_k(key if keep is None else jnp.where(keep, key, -jnp.inf), top_k)
        gates = jnp.take_along_axis(probs, ids, axis=-1)
    if routing.norm_topk_prob:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), (gates if routing.scaling == 1.0 else gates * routing.scaling)


def kernel_param(d_model: int, routing: Routing) -> dict[str, RouterParam]:
    return {"kernel": RouterParam("router_kernel", (d_model, routing.num_experts), ("embed", "router"))}


def balance_param(routing: Routing) -> dict[str, RouterParam]:
    """The balancing bias, when the routing asks for one."""
    if not routing.balance:
        return {}
    return {"bias": RouterParam("router_bias", (routing.num_experts,), ("router",), "bias", top_name="top_bias")}


def torch_linear_route(torch, act, x, p, r, keep):
    logits = x @ p["kernel"].float()
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    probs = torch.sigmoid(logits) if r["scoring"] == "sigmoid" else torch.softmax(logits, dim=-1)
    key = probs + p["bias"].float() if "bias" in p else probs  # balancing bias: the choice only
    ids = torch.topk(key if keep is None else key.masked_fill(~keep, float("-inf")), r["top_k"], dim=-1).indices
    gates = probs.gather(-1, ids)
    gates = gates / gates.sum(-1, keepdim=True) if r["norm_topk_prob"] else gates
    return ids, gates * r["scaling"]


class LinearRouter(Router):
    name = "linear"
    checkpoint_router = True
    options = ("balance", "scoring", "scaling", "jitter")
    torch_route = torch_linear_route

    def params(self, d_model, routing):
        return {**kernel_param(d_model, routing), **balance_param(routing)}

    def route(self, x, p, routing, keep=None):
        return linear_route(x, p["kernel"], routing, keep=keep, bias=p.get("bias"))

    def logits(self, x, p, routing):
        return masked_logits(x, p["kernel"])

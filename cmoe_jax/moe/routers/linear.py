"""The "linear" router (Qwen3-MoE, Mixtral, ExpertWeaver): softmax over all experts of
`x @ W_r`, the top-k probabilities as gates, optionally renormalised to sum 1 (Mixtral).

With `router_balance` the choice is the top-k of `probs + b`, b `[E]` a balancing bias that
`MoEFFN.update_bias` moves towards equal loads (aux-loss-free balancing, DeepSeek-V3); the
gates stay the chosen experts' probabilities, so b steers which experts run, not how much
they count, and gets no gradient."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cmoe_jax.moe.routers.base import Router, RouterParam, Routing


def masked_logits(x, kernel, keep=None):
    """float32 `x @ W_r`, -inf for the experts not kept."""
    logits = jnp.dot(x.astype(jnp.float32), kernel.astype(jnp.float32))
    return logits if keep is None else jnp.where(keep, logits, -jnp.inf)


def linear_route(x, kernel, top_k: int, norm_topk_prob: bool = False, keep=None, bias=None):
    """`keep` (bool `[E]`, optional): experts not kept get logit -inf (pruned); `bias` (`[E]`,
    optional): the balancing bias added for the choice only."""
    probs = jax.nn.softmax(masked_logits(x, kernel, keep), axis=-1)
    if bias is None:
        gates, ids = jax.lax.top_k(probs, top_k)
    else:
        key = probs + jax.lax.stop_gradient(bias.astype(jnp.float32))
        _, ids = jax.lax.top_k(key if keep is None else jnp.where(keep, key, -jnp.inf), top_k)
        gates = jnp.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), gates


def kernel_param(d_model: int, routing: Routing) -> dict[str, RouterParam]:
    return {"kernel": RouterParam("router_kernel", (d_model, routing.num_experts), ("embed", "router"))}


def balance_param(routing: Routing) -> dict[str, RouterParam]:
    """The balancing bias, when the routing asks for one."""
    if not routing.balance:
        return {}
    return {"bias": RouterParam("router_bias", (routing.num_experts,), ("router",), "bias", top_name="top_bias")}


def torch_linear_route(torch, act, x, p, k, norm, keep):
    logits = x @ p["kernel"].float()
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if "bias" in p:  # balancing bias: the choice only
        key = probs + p["bias"].float()
        ids = torch.topk(key if keep is None else key.masked_fill(~keep, float("-inf")), k, dim=-1).indices
        gates = probs.gather(-1, ids)
    else:
        gates, ids = torch.topk(probs, k, dim=-1)
    return ids, (gates / gates.sum(-1, keepdim=True) if norm else gates)


class LinearRouter(Router):
    name = "linear"
    options = ("balance",)
    torch_route = torch_linear_route

    def params(self, d_model, routing):
        return {**kernel_param(d_model, routing), **balance_param(routing)}

    def route(self, x, p, routing, keep=None):
        return linear_route(x, p["kernel"], routing.top_k, routing.norm_topk_prob, keep=keep, bias=p.get("bias"))

    def logits(self, x, p, routing):
        return masked_logits(x, p["kernel"])

"""The "linear" router (Qwen3-MoE, Mixtral, ExpertWeaver): softmax over all experts of
`x @ W_r`, the top-k probabilities as gates, optionally renormalised to sum 1 (Mixtral)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cmoe_jax.moe.routers.base import Router, RouterParam, Routing


def masked_logits(x, kernel, keep=None):
    """float32 `x @ W_r`, -inf for the experts not kept."""
    logits = jnp.dot(x.astype(jnp.float32), kernel.astype(jnp.float32))
    return logits if keep is None else jnp.where(keep, logits, -jnp.inf)


def linear_route(x, kernel, top_k: int, norm_topk_prob: bool = False, keep=None):
    """`keep` (bool `[E]`, optional): experts not kept get logit -inf (pruned)."""
    probs = jax.nn.softmax(masked_logits(x, kernel, keep), axis=-1)
    gates, ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), gates


def kernel_param(d_model: int, routing: Routing) -> dict[str, RouterParam]:
    return {"kernel": RouterParam("router_kernel", (d_model, routing.num_experts), ("embed", "router"))}


def torch_linear_route(torch, act, x, p, k, norm, keep):
    logits = x @ p["kernel"].float()
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    gates, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    return ids, (gates / gates.sum(-1, keepdim=True) if norm else gates)


class LinearRouter(Router):
    name = "linear"
    torch_route = torch_linear_route

    def params(self, d_model, routing):
        return kernel_param(d_model, routing)

    def route(self, x, p, routing, keep=None):
        return linear_route(x, p["kernel"], routing.top_k, routing.norm_topk_prob, keep=keep)

    def logits(self, x, p, routing):
        return masked_logits(x, p["kernel"])

"""The "topsum" router (ExpertWeaver's training-free router): the top-k experts by the
logits `x @ W_r`, each of weight 1 (the selected experts' outputs are summed unweighted)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cmoe_jax.moe.routers.base import Router
from cmoe_jax.moe.routers.linear import kernel_param, masked_logits


def topsum_route(x, kernel, top_k: int, keep=None):
    """`keep` as in `linear_route`."""
    _, ids = jax.lax.top_k(masked_logits(x, kernel, keep), top_k)
    return ids.astype(jnp.int32), jnp.ones(ids.shape, jnp.float32)


def torch_topsum_route(torch, act, x, p, r, keep):
    logits = x @ p["kernel"].float()
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    ids = torch.topk(logits, r["top_k"], dim=-1).indices
    return ids, torch.ones(ids.shape, device=x.device)


class TopSumRouter(Router):
    name = "topsum"
    learned_gates = False
    torch_route = torch_topsum_route

    def params(self, d_model, routing):
        return kernel_param(d_model, routing)

    def route(self, x, p, routing, keep=None):
        return topsum_route(x, p["kernel"], routing.top_k, keep=keep)

    def logits(self, x, p, routing):
        return masked_logits(x, p["kernel"])

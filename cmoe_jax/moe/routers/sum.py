"""The "sum" router: every expert, weight 1 (the dense FFN split into experts, exact)."""
from __future__ import annotations

import jax.numpy as jnp

from cmoe_jax.moe.routers.base import Router


def sum_route(num_tokens: int, num_experts: int):
    ids = jnp.broadcast_to(jnp.arange(num_experts, dtype=jnp.int32), (num_tokens, num_experts))
    return ids, jnp.ones((num_tokens, num_experts), jnp.float32)


def torch_sum_route(torch, act, x, p, r, keep):
    ids = torch.arange(r["top_k"], device=x.device).expand(x.shape[0], -1)
    return ids, torch.ones(ids.shape, device=x.device)


class SumRouter(Router):
    name = "sum"
    learned_gates = False
    torch_route = torch_sum_route

    def check(self, routing):
        if routing.top_k != routing.num_experts:
            raise ValueError(f"router='sum' activates every expert: top_k must be {routing.num_experts}")

    def params(self, d_model, routing):
        return {}

    def route(self, x, p, routing, keep=None):
        return sum_route(x.shape[0], routing.num_experts)

    def logits(self, x, p, routing):
        return jnp.zeros((x.shape[0], routing.num_experts), jnp.float32)

"""Token dispatch for routed experts: sort by expert, grouped matmuls, unsort, combine.

Static shapes and no capacity limit, so no token is ever dropped: the `T * k`
(token, slot) pairs are stably sorted by expert id, their rows gathered into one `[T*k, d]`
matrix grouped by expert, run through the experts' SwiGLU with three grouped matmuls, scaled
by their gate weights and gathered back with the inverse permutation. The result equals the
per-token sum over the selected experts of `gate * expert(x)`.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


class Dispatch(NamedTuple):
    order: jax.Array        # int32 [T*k]: sorted position -> flat (token, slot) index
    inverse: jax.Array      # int32 [T*k]: flat (token, slot) index -> sorted position
    group_sizes: jax.Array  # int32 [E]: rows per expert (= tokens routed to it)


def plan(expert_ids: jax.Array, num_experts: int) -> Dispatch:
    """Sort the flattened (token, slot) pairs `expert_ids [T, k]` by expert id (stable)."""
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return Dispatch(order, inverse, sizes)


def routed_experts(x: jax.Array, expert_ids: jax.Array, gates: jax.Array, w_gate: jax.Array,
                   w_up: jax.Array, w_down: jax.Array, gmm: Callable,
                   lora: Callable | None = None) -> tuple[jax.Array, jax.Array]:
    """sum_k gates[t, k] * expert_{ids[t, k]}(x[t]) for `x [T, d]`; also the group sizes.

    `w_gate`, `w_up` are `[E, d, m]`, `w_down` `[E, m, d]`; `gmm(lhs, rhs, sizes)` is a grouped
    matmul backend (`cmoe_jax.moe.gmm.get_gmm`). The k expert outputs of a token are summed
    in float32.

    `lora(name, rows, group_sizes)`, optional, adds a low-rank delta to the projection `name`
    ("gate", "up" or "down") of the sorted rows (or returns None for none): LoRA adapters
    stacked per expert run through the same grouped matmuls (`cmoe_jax.train`).
    """
    num_tokens, top_k = expert_ids.shape
    d = plan(expert_ids, w_gate.shape[0])
    xs = x[d.order // top_k]

    def proj(name, rows, w):
        y = gmm(rows, w, d.group_sizes)
        delta = lora(name, rows, d.group_sizes) if lora is not None else None
        return y if delta is None else y + delta.astype(y.dtype)

    h = jax.nn.silu(proj("gate", xs, w_gate)) * proj("up", xs, w_up)
    ys = proj("down", h.astype(x.dtype), w_down)
    y = ys[d.inverse].astype(jnp.float32).reshape(num_tokens, top_k, -1)
    out = jnp.einsum("tkd,tk->td", y, gates.astype(jnp.float32))
    return out, d.group_sizes

"""The padded dispatch: every expert's rows padded to one capacity, three batched matmuls.

The sort path's grouped matmuls visit the experts' row windows one after another (the CPU's
loop of windows, the GPU's Pallas kernel at about half cuBLAS's rate). Padding each
expert's group to a common capacity `C` turns them into one batched product
`[E, C, d] x [E, d, m]`, the platform's plain batched matmul (oneDNN, cuBLAS), at the price
of computing `E * C` rows instead of `T * k`.

`C` must be static but the largest group is known only at run time, so a ladder of
capacities (`capacity_ladder`: a few multiples of the mean group, from balanced to twice
it) is compiled, one `lax.switch` branch each, and the smallest that holds the largest group
runs. A routing more uneven than the last rung runs the sort path, so no pair is ever
dropped and the padding costs at most twice the routed products; for calls of few pairs an
expert, where the sort is slower than every expert on every token, the last rung instead
holds every token (`cover_tokens`), which no routing of distinct experts a token overflows.
Same products, dtypes and float32 combine as the sort path.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from cmoe_jax.moe.activations import glu_activation
from cmoe_jax.moe.dispatch import Dispatch, GLUExperts, combine, plan, routed_experts

# capacities as multiples of the mean group `T * k / E`: a converted SmolLM2's largest group
# is 1.06-1.35x the mean at 2048 tokens (median 1.13), so the first rungs are close; the last
# holds an expert with twice its share (more uneven routings sort)
LADDER = (1.125, 1.25, 1.5, 2.0)
# capacities rounded up to whole vector rows; small ones to pairs of rows, since there a row
# is a sizeable share of the products (XLA:CPU's batched matmul over 576x192 experts: its
# time grows with every second row of capacity from 1 to 16, benchmarks/moe_breakdown.py)
ROW_MULTIPLE, SMALL_ROW_MULTIPLE, SMALL_CAPACITY = 8, 2, 32


def capacity_ladder(num_pairs: int, num_experts: int, tokens: int | None = None,
                    factors=LADDER) -> tuple[int, ...]:
    """Increasing static capacities for `num_pairs` pairs over `num_experts` experts; with
    `tokens`, capped at it and ending at it (the most pairs an expert gets from `tokens`
    tokens whose slots name distinct experts)."""
    mean = num_pairs / num_experts
    top = min(num_pairs, tokens or num_pairs)
    caps = {min(top, _rounded(f * mean)) for f in factors} | ({top} if tokens else set())
    return tuple(sorted(caps))


def _rounded(rows: float) -> int:
    step = SMALL_ROW_MULTIPLE if rows <= SMALL_CAPACITY else ROW_MULTIPLE
    return step * math.ceil(rows / step)


def group_starts(d: Dispatch) -> jax.Array:
    """int32 `[E]`: each expert's first position in the sorted pairs."""
    return jnp.cumsum(d.group_sizes) - d.group_sizes


@jax.named_scope("dispatch")
def padded_rows(x: jax.Array, d: Dispatch, top_k: int, capacity: int) -> jax.Array:
    """`[E, C, d]`: expert e's rows in sorted order, then copies of row 0 as padding."""
    offsets = group_starts(d)
    slot = jnp.arange(capacity, dtype=jnp.int32)
    position = jnp.minimum(offsets[:, None] + slot, d.order.shape[0] - 1)
    used = slot < d.group_sizes[:, None]
    return x[jnp.where(used, d.order[position] // top_k, 0)]


def padded_output_rows(ids: jax.Array, d: Dispatch, capacity: int) -> jax.Array:
    """int32 `[T*k]`: each (token, slot) pair's row in the padded outputs `[E * C, d]`. A
    dropped pair (id E) points at some other row, which `combine` skips for it."""
    num_experts = d.group_sizes.shape[0]
    expert = jnp.minimum(ids.reshape(-1), num_experts - 1)
    slot = jnp.clip(d.inverse - group_starts(d)[expert], 0, capacity - 1)
    return expert * capacity + slot


@jax.named_scope("experts")
def padded_glu(rows: jax.Array, experts: GLUExperts) -> jax.Array:
    """Each expert's GLU on its padded rows `[E, C, d]`, float32 accumulation."""
    mm = lambda a, w: jnp.einsum("ecd,edm->ecm", a, w, preferred_element_type=jnp.float32)  # noqa: E731
    h = glu_activation(experts.activation)(mm(rows, experts.w_gate)) * mm(rows, experts.w_up)
    return mm(h.astype(rows.dtype), experts.w_down)


def padded_experts(x: jax.Array, ids: jax.Array, gates: jax.Array, experts: GLUExperts,
                   cover_tokens: bool = False) -> tuple[jax.Array, jax.Array]:
    """`dispatch.routed_experts` with the groups padded to the smallest capacity of the
    ladder that holds the largest one (module doc); the sort path beyond the last, which with
    `cover_tokens` holds every token."""
    num_tokens, top_k = ids.shape
    num_experts = experts.w_gate.shape[0]
    d = plan(ids, num_experts)

    def at_capacity(capacity):
        def run(x, gates):
            ys = padded_glu(padded_rows(x, d, top_k, capacity), experts)
            return combine(ys.reshape(-1, ys.shape[-1]), gates, padded_output_rows(ids, d, capacity),
                           ran=ids.reshape(-1) < num_experts)
        return run

    caps = capacity_ladder(ids.size, num_experts, num_tokens if cover_tokens else None)
    branches = [at_capacity(c) for c in caps] + [lambda x, g: routed_experts(x, ids, g, experts)[0]]
    rung = jnp.sum(jnp.asarray(caps, jnp.int32) < jnp.max(d.group_sizes))
    return jax.lax.switch(rung, branches, x, gates), d.group_sizes

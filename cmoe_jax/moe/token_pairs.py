"""Which (token, slot) pairs run an expert: the token mask and the capacity factor.

A pair that does not run is *dropped*: its expert id becomes `num_experts` (one past the
last expert, an id no expert has) and its gate 0. Every dispatch path treats such an id
the same way (`cmoe_jax.moe.dispatch`, `cmoe_jax.moe.expert_parallel`): the pair is sent
nowhere, runs nothing, adds nothing to the output and is not counted in the loads. Two
things drop pairs:

- the token mask (`layer(x, mask=...)`, False for padding): all k pairs of a masked token,
  so padding never takes an expert's capacity, never counts in the loads, the auxiliary
  losses or the balancing bias update; its output is the shared MLP's alone (zeros
  without one);
- the capacity factor c (`FFNSpec.capacity_factor`, 0: none, dropless): each expert runs
  at most `ceil(c * T * k / E)` pairs of a call's T tokens (per device under expert
  parallelism, where T is the device's tokens). Pairs compete for it in slot order, then
  token order: every token's first choice before any second choice (GShard), so a
  dropped pair is the least preferred one. The share dropped is `RouterOutput.dropped`.

Expert parallelism pads the tokens to a multiple of the device count with masked tokens
(`pad_tokens`), so any token count runs.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cmoe_jax.moe.mesh_axes import tokens_sharded


class Pairs(NamedTuple):
    """A call's routing as its outputs report it: the router's choice `ids [T, k]`, the token
    `mask [T]` and the pairs that ran `keep [T, k]` (None: all of them)."""

    ids: jax.Array
    mask: jax.Array | None
    keep: jax.Array | None


def capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Pairs one expert may run: `ceil(factor * T * k / E)`, at most T (a token picks an
    expert once); T when `factor` is 0 (no limit)."""
    if factor <= 0:
        return num_tokens
    return max(1, min(num_tokens, math.ceil(factor * num_tokens * top_k / num_experts)))


def kept_pairs(ids: jax.Array, num_experts: int, mask: jax.Array | None = None,
               factor: float = 0.0, *, per_device: bool = False) -> jax.Array | None:
    """bool `[T, k]`: the pairs of expert ids `[T, k]` that run, given the token `mask`
    (bool `[T]`, optional) and the capacity `factor`; None when every pair runs.
    `per_device`: expert-parallel, each device applies the capacity to its own tokens."""
    if per_device and factor > 0:
        live = jnp.ones(ids.shape[:1], bool) if mask is None else mask
        return tokens_sharded(lambda a, _: kept_pairs(a[0], num_experts, a[1], factor), (ids, live), None)
    num_tokens, top_k = ids.shape
    keep = None if mask is None else jnp.broadcast_to(mask.astype(bool)[:, None], ids.shape)
    limit = capacity(num_tokens, top_k, num_experts, factor)
    if limit >= num_tokens:
        return keep
    # rank of each pair within its expert, first slots first: sort the slot-major pairs
    ranked = ids if keep is None else jnp.where(keep, ids, num_experts)
    flat = ranked.T.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts + 1)
    starts = jnp.cumsum(sizes) - sizes
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(flat.size, dtype=order.dtype) - starts[flat[order]])
    within = (rank < limit).reshape(top_k, num_tokens).T
    return within if keep is None else within & keep


def drop_pairs(ids: jax.Array, gates: jax.Array, keep: jax.Array | None, num_experts: int):
    """`(ids, gates)` with the pairs not kept dropped (id `num_experts`, gate 0)."""
    if keep is None:
        return ids, gates
    return jnp.where(keep, ids, num_experts).astype(jnp.int32), jnp.where(keep, gates, 0.0)


def load_of(ids: jax.Array, keep: jax.Array | None, num_experts: int) -> jax.Array:
    """int32 `[E]`: the pairs of `ids [T, k]` each expert ran (those kept)."""
    ran = ids if keep is None else jnp.where(keep, ids, num_experts)
    return jnp.bincount(ran.reshape(-1), length=num_experts).astype(jnp.int32)


def dropped_share(keep: jax.Array | None, mask: jax.Array | None) -> jax.Array:
    """float32 []: the share of the unmasked tokens' pairs that capacity dropped."""
    if keep is None:
        return jnp.zeros((), jnp.float32)
    live = jnp.ones(keep.shape, bool) if mask is None else jnp.broadcast_to(mask[:, None], keep.shape)
    total = jnp.sum(live)
    return jnp.where(total > 0, jnp.sum(live & ~keep) / jnp.maximum(total, 1), 0.0).astype(jnp.float32)


def pad_tokens(x: jax.Array, mask: jax.Array | None, multiple: int):
    """`x [T, d]` and its mask padded with masked zero tokens to a multiple of `multiple`
    (the mask None when nothing was padded or masked)."""
    pad = -x.shape[0] % multiple
    if pad == 0:
        return x, mask
    live = jnp.ones((x.shape[0],), bool) if mask is None else mask.astype(bool)
    return (jnp.concatenate([x, jnp.zeros((pad, x.shape[1]), x.dtype)]),
            jnp.concatenate([live, jnp.zeros((pad,), bool)]))

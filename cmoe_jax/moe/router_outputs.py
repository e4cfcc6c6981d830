"""Opt-in router outputs of an MoE layer: logits, probabilities, load and auxiliary losses.

Computed only when asked for (`layer(x, return_router=True)`, or `sow_router=True` to sow
them as `nnx.Intermediate`), so the plain forward pass costs nothing more. The losses are
the usual ones for training a router from scratch:

- Switch load-balancing loss (Fedus et al. 2021): `E * sum_e f_e P_e`, `f_e` the fraction of
  the `T * k` (token, slot) pairs routed to expert e (not differentiable), `P_e` the mean
  router probability of e over the tokens; 1 when perfectly balanced.
- router z-loss (Zoph et al. 2022, ST-MoE): mean over tokens of `logsumexp(logits)^2`,
  keeping the logits small.

Both are over the real tokens only when the call had a token mask.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from cmoe_jax.moe.token_pairs import dropped_share, load_of


class RouterOutput(NamedTuple):
    """What the router did for one call (leading token dims `...` as the input's)."""

    logits: jax.Array    # float32 [..., E] scores before the softmax (-inf: a pruned slot)
    probs: jax.Array     # float32 [..., E] softmax of the logits
    load: jax.Array      # int32 [E] (token, slot) pairs each expert ran
    aux_loss: jax.Array  # float32 [] Switch load-balancing loss
    z_loss: jax.Array    # float32 [] router z-loss
    dropped: jax.Array   # float32 [] share of the real tokens' pairs the capacity dropped


def router_output(logits: jax.Array, ids: jax.Array, lead_shape: tuple, mask=None, keep=None
                  ) -> RouterOutput:
    """Probabilities, load and losses from `logits [T, E]` and the chosen `ids [T, k]`.

    `mask` (bool `[T]`): the real tokens; padding counts in no load, loss or mean.
    `keep` (bool `[T, k]`): the pairs that ran (`cmoe_jax.moe.token_pairs`): the load counts
    those, the Switch loss the router's choice before any capacity drop."""
    num_tokens, num_experts = logits.shape
    live = jnp.ones((num_tokens,), bool) if mask is None else mask
    chosen = jnp.where(live[:, None], ids, num_experts)
    load = load_of(chosen, keep, num_experts)
    count = jnp.maximum(jnp.sum(live), 1).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1) if num_tokens else jnp.zeros(logits.shape, jnp.float32)
    frac = jax.lax.stop_gradient(load_of(chosen, None, num_experts) / (count * ids.shape[1]))
    mean_probs = jnp.sum(jnp.where(live[:, None], probs, 0.0), axis=0) / count
    aux = num_experts * jnp.sum(frac * mean_probs)
    lse = jax.nn.logsumexp(logits, axis=-1) if num_tokens else jnp.zeros((0,), jnp.float32)
    z = jnp.sum(jnp.where(live, jnp.square(lse), 0.0)) / count
    as_lead = lambda a: a.reshape(*lead_shape, num_experts)  # noqa: E731
    return RouterOutput(as_lead(logits), as_lead(probs), load, aux, z, dropped_share(keep, mask))

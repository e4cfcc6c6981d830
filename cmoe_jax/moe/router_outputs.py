"""Opt-in router outputs of an MoE layer: logits, probabilities, load and auxiliary losses.

Computed only when asked for (`layer(x, return_router=True)`, or `sow_router=True` to sow
them as `nnx.Intermediate`), so the plain forward pass costs nothing more. The losses are
the usual ones for training a router from scratch:

- Switch load-balancing loss (Fedus et al. 2021): `E * sum_e f_e P_e`, `f_e` the fraction of
  the `T * k` (token, slot) pairs routed to expert e (not differentiable), `P_e` the mean
  router probability of e over the tokens; 1 when perfectly balanced.
- router z-loss (Zoph et al. 2022, ST-MoE): mean over tokens of `logsumexp(logits)^2`,
  keeping the logits small.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class RouterOutput(NamedTuple):
    """What the router did for one call (leading token dims `...` as the input's)."""

    logits: jax.Array    # float32 [..., E] scores before the softmax (-inf: a pruned slot)
    probs: jax.Array     # float32 [..., E] softmax of the logits
    load: jax.Array      # int32 [E] (token, slot) pairs routed to each expert
    aux_loss: jax.Array  # float32 [] Switch load-balancing loss
    z_loss: jax.Array    # float32 [] router z-loss


def router_output(logits: jax.Array, ids: jax.Array, lead_shape: tuple) -> RouterOutput:
    """Probabilities, load and losses from `logits [T, E]` and the chosen `ids [T, k]`."""
    num_tokens, num_experts = logits.shape
    load = jnp.bincount(ids.reshape(-1), length=num_experts).astype(jnp.int32)
    if num_tokens == 0:
        zero = jnp.zeros((), jnp.float32)
        probs = jnp.zeros(logits.shape, jnp.float32)
        return RouterOutput(logits.reshape(*lead_shape, num_experts),
                            probs.reshape(*lead_shape, num_experts), load, zero, zero)
    probs = jax.nn.softmax(logits, axis=-1)
    frac = jax.lax.stop_gradient(load.astype(jnp.float32) / ids.size)
    aux = num_experts * jnp.sum(frac * jnp.mean(probs, axis=0))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return RouterOutput(logits.reshape(*lead_shape, num_experts),
                        probs.reshape(*lead_shape, num_experts), load, aux, z)

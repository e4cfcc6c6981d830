"""Auxiliary-loss-free load balancing of the CMoE router (paper sec. 3.3, as in DeepSeek-V3).

After each training step the selection bias `b` of every MoE layer moves by `+gamma` for
experts that received fewer tokens than the mean and by `-gamma` for those that received
more, outside the gradient. `b` only changes which experts are chosen, never the gates.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RouterBias(nnx.Variable):
    """Selection bias of the CMoE router: state, not a parameter (optimisers skip it)."""


class RouterThreshold(nnx.Variable):
    """The score a chosen expert must reach to run (threshold routing): fitted at
    conversion, not a parameter (optimisers skip it, so no weight decay moves it)."""


def update_router_bias(layer_or_bias, counts: jax.Array, gamma: float) -> jax.Array:
    """New bias `b + gamma * sign(mean(counts) - counts)`; pure, nothing is modified.

    `layer_or_bias` is a `MoEFFN` (its `router_bias`), a `RouterBias` or an array; `counts`
    the tokens routed to each expert (`MoEFFN(..., return_load=True)`), summed over any
    number of batches. Assign the result back with `layer.router_bias[...] = new_b`, or use
    `MoEFFN.update_bias`.
    """
    bias = getattr(layer_or_bias, "router_bias", layer_or_bias)
    if isinstance(bias, nnx.Variable):
        bias = bias[...]
    bias = jax.lax.stop_gradient(jnp.asarray(bias))
    load = jnp.asarray(counts, jnp.float32)
    # per row: a hierarchical layer's [N, N'_r] loads balance each sub-router on its own
    step = jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load) * gamma
    return (bias.astype(jnp.float32) + step).astype(bias.dtype)

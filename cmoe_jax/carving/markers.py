"""ATopK activation markers and activation rates of FFN neurons (jit, data-parallel).

h = Swish(x W_gate) * (x W_up) is computed on L2-normalised tokens and weight columns by
default (as the authors' code does), so the markers reflect activation patterns rather than
token norms; `normalize=False` gives the plain form.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def normalize_columns(w: jax.Array) -> jax.Array:
    """Each neuron's weight column ([d, d_h] layout) scaled to unit L2 norm."""
    w = w.astype(jnp.float32)
    return w / jnp.maximum(jnp.linalg.norm(w, axis=0, keepdims=True), 1e-12)


def ffn_hidden(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, normalize: bool = True) -> jax.Array:
    """Hidden activations [N, d_h] of a SwiGLU FFN for tokens x [N, d]."""
    x = x.astype(jnp.float32)
    if normalize:
        x = x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
        w_gate, w_up = normalize_columns(w_gate), normalize_columns(w_up)
    return jax.nn.silu(x @ w_gate.astype(jnp.float32)) * (x @ w_up.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("k_act", "normalize"))
def profile_markers(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, *, k_act: int,
                    normalize: bool = True) -> tuple[jax.Array, jax.Array]:
    """(markers bool [N, d_h], activation rates mu [d_h]) for tokens x [N, d].

    A token marks the K_a neurons with the largest |h|. With x sharded over a data axis the
    markers stay sharded and mu's token sum becomes a cross-device reduction.
    """
    h = jnp.abs(ffn_hidden(x, w_gate, w_up, normalize))
    _, top = jax.lax.top_k(h, k_act)
    markers = jnp.zeros(h.shape, jnp.bool_).at[jnp.arange(h.shape[0])[:, None], top].set(True)
    mu = markers.sum(axis=0, dtype=jnp.int32).astype(jnp.float32) / h.shape[0]
    return markers, mu

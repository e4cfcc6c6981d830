"""Profile of one FFN: ATopK activation markers, activation rates, output energies (jit).

h = Swish(x W_gate) * (x W_up) is computed on L2-normalised tokens and weight columns by
default (as the authors' code does: F.normalize on the token and on each neuron's weight
row of the torch [d_h, d] weight, i.e. each column of our [d, d_h] layout), so the markers
reflect activation patterns rather than norms; `normalize=False` gives the plain form.

A token marks the K_a neurons with the largest |h| (ATopK); mu is the mean marker over
tokens; the binary markers are what the clustering needs. With x sharded over a data axis
the markers stay sharded and mu's token sum becomes a cross-device reduction.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cmoe_jax.moe.activations import glu_activation


def _atopk(h: jax.Array, k_act: int) -> jax.Array:
    _, top = jax.lax.top_k(jnp.abs(h), k_act)
    return jnp.zeros(h.shape, jnp.bool_).at[jnp.arange(h.shape[0])[:, None], top].set(True)


@functools.partial(jax.jit, static_argnames=("k_act", "normalize", "windows", "activation"))
def profile_layer(x, w_gate, w_up, w_down, *, k_act: int, normalize: bool = True,
                  windows: int | None = None, activation: str):
    """(markers [N, d_h], mu [d_h], energy [d_h]) of one FFN from a single pair of matmuls.

    energy_i = mean over tokens of h_i^2 * ||W_down[i]||^2 on the plain (unnormalised) hidden
    state: the mean squared norm of neuron i's contribution to the FFN output, i.e. what
    leaving it out of the always-on set can cost. The normalised h of the markers is derived
    from the same pre-activations (x W / (|x| |w|)), so the profile costs one FFN pass.

    `windows`: x holds that many equal windows of tokens, and energy is returned as each
    window's sum [windows, d_h] instead of the mean: sums the caller can add up in a fixed
    order, whichever process or device computed each window (`cmoe_jax.distributed`).
    `activation`: the FFN's GLU activation (`cmoe_jax.moe.activations`).
    """
    act = glu_activation(activation)
    x = jnp.asarray(x).astype(jnp.float32)
    w_gate, w_up = jnp.asarray(w_gate).astype(jnp.float32), jnp.asarray(w_up).astype(jnp.float32)
    g, u = x @ w_gate, x @ w_up
    plain = act(g) * u
    if normalize:
        x_norm = jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
        col = lambda w: jnp.maximum(jnp.linalg.norm(w, axis=0), 1e-12)
        h = act(g / (x_norm * col(w_gate))) * (u / (x_norm * col(w_up)))
    else:
        h = plain
    markers = _atopk(h, k_act)
    mu = markers.sum(axis=0, dtype=jnp.int32).astype(jnp.float32) / markers.shape[0]
    down_sq = _down_sq(w_down)
    if windows is not None:
        return markers, mu, jnp.square(plain).reshape(windows, -1, plain.shape[-1]).sum(1) * down_sq
    energy = jnp.mean(jnp.square(plain), axis=0) * down_sq
    return markers, mu, energy


def _down_sq(w_down):
    return jnp.sum(jnp.square(jnp.asarray(w_down).astype(jnp.float32)), axis=1)


@functools.partial(jax.jit, static_argnames=("activation",))
def output_energy(x, w_gate, w_up, w_down, activation: str):
    """energy [d_h] of `profile_layer` alone (no markers), for tokens x [..., d], float32."""
    x = jnp.asarray(x).astype(jnp.float32).reshape(-1, x.shape[-1])
    h = glu_activation(activation)(x @ jnp.asarray(w_gate).astype(jnp.float32)) * (x @ jnp.asarray(w_up).astype(jnp.float32))
    return jnp.mean(jnp.square(h), axis=0) * _down_sq(w_down)

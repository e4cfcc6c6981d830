"""The skipped experts' compensation of a cmoe-routed layer (`FFNSpec.skip_compensation`).

An expert a token does not run would have added its output; the layer predicts that part
linearly from the activations h of the expert's router neurons, which the router has just
computed to score it:

    skip(x) = (h(x) * skipped) @ skip_down,    h [T, E*r],  skip_down [E*r, d]

`skipped` is 1 on the r columns of each expert outside the token's top-k. `skip_down` is
fitted by least squares together with the down projections at conversion
(`cmoe_jax.methods.cmoe.layer_fit.fit_down`); a fresh layer's is zero, so the term is off.
"""
from __future__ import annotations

import jax.numpy as jnp

from cmoe_jax.moe.routers.cmoe import router_activations


def skipped_activations(x, router_gate, router_up, slots, num_experts: int, *, activation: str):
    """float32 `[T, E*r]`: the router neurons' h of the experts each token of `x [T, d]`
    skips, 0 on the columns of the experts it chose (`slots [T, k]`, of `num_experts` E)."""
    h = router_activations(x, router_gate, router_up, activation=activation)
    tokens = slots.shape[0]
    chosen = jnp.zeros((tokens, num_experts), bool).at[jnp.arange(tokens)[:, None], slots].set(True)
    return jnp.where(jnp.repeat(chosen, h.shape[1] // num_experts, axis=1), 0.0, h)


def skip_term(x, router_gate, router_up, skip_down, slots, num_experts: int, *, activation: str,
              mask=None):
    """float32 `[T, d]`: the skipped experts' predicted outputs for tokens `x [T, d]` whose
    chosen experts are `slots [T, k]`; `mask` (bool `[T]`): padding gets 0, as it runs no expert."""
    f = skipped_activations(x, router_gate, router_up, slots, num_experts, activation=activation)
    if mask is not None:
        f = jnp.where(mask[:, None], f, 0.0)
    return f @ skip_down.astype(jnp.float32)

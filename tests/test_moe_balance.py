"""Router-bias load balancing (CMoE sec. 3.3, DeepSeek-V3 style)."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from cmoe_jax.moe import MoEFFN, RouterBias, update_router_bias


def test_moves_towards_mean_load():
    bias = jnp.array([0.0, 0.5, -0.2, 0.1])
    counts = jnp.array([10, 2, 4, 0], jnp.int32)  # mean 4: over, under, equal, under
    new = update_router_bias(bias, counts, 0.01)
    np.testing.assert_allclose(np.asarray(new), [-0.01, 0.51, -0.2, 0.11], atol=1e-7)
    np.testing.assert_array_equal(np.asarray(bias), np.float32([0.0, 0.5, -0.2, 0.1]))  # pure


def test_accepts_layer_and_variable_and_update_bias_in_place():
    layer = MoEFFN(d_model=8, expert_width=4, num_experts=4, top_k=1, router="cmoe", activation="silu", rngs=nnx.Rngs(0))
    counts = jnp.array([7, 1, 0, 0], jnp.int32)
    from_layer = update_router_bias(layer, counts, 0.5)
    from_var = update_router_bias(layer.router_bias, counts, 0.5)
    np.testing.assert_array_equal(np.asarray(from_layer), [-0.5, 0.5, 0.5, 0.5])
    np.testing.assert_array_equal(np.asarray(from_var), np.asarray(from_layer))
    assert float(jnp.abs(layer.router_bias[...]).max()) == 0  # untouched
    layer.update_bias(counts, 0.5)
    np.testing.assert_array_equal(np.asarray(layer.router_bias[...]), [-0.5, 0.5, 0.5, 0.5])
    assert isinstance(layer.router_bias, RouterBias)
    with pytest.raises(ValueError, match="cmoe router"):
        MoEFFN(d_model=8, expert_width=4, num_experts=4, top_k=1, router="linear", activation="silu", rngs=nnx.Rngs(0)).update_bias(counts, 0.1)


def test_jittable_and_outside_the_gradient():
    f = jax.jit(update_router_bias, static_argnums=2)
    np.testing.assert_allclose(np.asarray(f(jnp.zeros(3), jnp.array([3, 0, 0]), 0.1)),
                               [-0.1, 0.1, 0.1])
    g = jax.grad(lambda b: jnp.sum(update_router_bias(b, jnp.array([3, 0, 0]), 0.1)))(jnp.zeros(3))
    np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_balancing_loop_spreads_skewed_routing():
    """Routing that sends every token to one expert is spread out by repeated bias updates."""
    e, n = 4, 256
    layer = MoEFFN(d_model=8, expert_width=4, num_experts=e, top_k=1, router="cmoe", activation="silu", rngs=nnx.Rngs(0))
    layer.router_gate[...] = layer.router_gate[...] * 50.0  # scores that differ per token
    layer.router_up[...] = layer.router_up[...] * 50.0
    layer.router_bias[...] = jnp.zeros((e,)).at[0].set(1.0)  # everything on expert 0
    x = jax.random.normal(jax.random.PRNGKey(0), (n, 8))
    load = nnx.jit(lambda m, x: m(x, return_load=True)[1])
    assert int(load(layer, x)[0]) == n
    for _ in range(300):
        layer.update_bias(load(layer, x), 0.005)
    last = np.asarray(load(layer, x))
    assert last.max() < 0.5 * n and (last > 0).sum() == e, last

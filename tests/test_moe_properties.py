"""Property tests of `MoEFFN` (hypothesis): for random token counts (0 included), widths,
expert counts, top_k, routers, shared widths and backends the output equals the per-token
numpy reference, the loads count every (token, slot) pair, gradients are finite, and an
input of any other width is refused. Derandomized, so CI sees the same examples every run."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax
import jax.numpy as jnp
from flax import nnx

from cmoe_jax.moe import ROUTER_KINDS, MoEFFN
from cmoe_jax.moe.gmm import cpu as gmm_cpu
from tests import moe_numpy

BACKENDS = {"cpu": "cpu", "cpu_small_blocks": gmm_cpu.make_gmm(windows=(4, 2)),
            "dense": "dense", "ragged_dot": "ragged_dot"}
# few examples: each new shape compiles, and the suite runs on two busy CPU cores
SETTINGS = settings(max_examples=15, deadline=None, derandomize=True, print_blob=True)


@st.composite
def layers(draw):
    num_experts = draw(st.integers(1, 6))
    router = draw(st.sampled_from(ROUTER_KINDS))
    top_k = num_experts if router == "sum" else draw(st.integers(1, num_experts))
    return dict(d=draw(st.sampled_from([4, 8, 12])), expert_width=draw(st.sampled_from([2, 4])),
                num_experts=num_experts, top_k=top_k, router=router,
                shared_width=draw(st.sampled_from([0, 4])),
                norm=router == "linear" and draw(st.booleans()),
                router_neurons=draw(st.integers(1, 2)) if router == "cmoe" else 1,
                backend=draw(st.sampled_from(sorted(BACKENDS))),
                lead=draw(st.sampled_from([(0,), (1,), (5,), (2, 3), (3, 0), (4, 4)])),
                seed=draw(st.integers(0, 2 ** 16)))


def build(c):
    layer = MoEFFN(d_model=c["d"], expert_width=c["expert_width"], num_experts=c["num_experts"], top_k=c["top_k"],
                   shared_width=c["shared_width"], router=c["router"], norm_topk_prob=c["norm"],
                   router_neurons=c["router_neurons"], backend=BACKENDS[c["backend"]],
                   activation="silu", rngs=nnx.Rngs(c["seed"] % 7))
    rng = np.random.default_rng(c["seed"])
    for _, var in nnx.to_flat_state(nnx.state(layer, nnx.Param)):  # distinct routing
        var.set_value(jnp.asarray(rng.normal(size=var.shape) * 0.5, jnp.float32))
    if c["router"] == "cmoe":
        layer.router_bias[...] = jnp.asarray(rng.normal(size=c["num_experts"]) * 0.05, jnp.float32)
    x = jnp.asarray(rng.normal(size=c["lead"] + (c["d"],)), jnp.float32)
    return layer, x


@SETTINGS
@given(layers())
def test_output_equals_the_per_token_reference(c):
    layer, x = build(c)
    y, load = layer(x, return_load=True)
    assert y.shape == x.shape and y.dtype == jnp.float32
    want, want_load, _ = moe_numpy.forward(layer, np.asarray(x, np.float64).reshape(-1, c["d"]))
    np.testing.assert_allclose(np.asarray(y).reshape(-1, c["d"]), want, rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(np.asarray(load), want_load)
    assert int(load.sum()) == int(np.prod(c["lead"])) * c["top_k"]


@settings(SETTINGS, max_examples=8)
@given(layers())
def test_gradients_are_finite(c):
    layer, x = build(c)

    def loss(m, x):
        y, r = m(x, return_router=True)
        return jnp.sum(jnp.sin(y)) + r.aux_loss + 1e-3 * r.z_loss

    g_layer, g_x = nnx.grad(loss, argnums=(0, 1))(layer, x)
    assert g_x.shape == x.shape
    for leaf in jax.tree.leaves(g_layer) + [g_x]:
        assert np.isfinite(np.asarray(leaf)).all()


@settings(SETTINGS, max_examples=15)
@given(layers(), st.data())
def test_any_other_width_is_refused(c, data):
    layer, _ = build(c)
    width = data.draw(st.integers(1, 24).filter(lambda w: w != c["d"]))
    with pytest.raises(ValueError, match=rf"d_model={c['d']}\b.*\b{width}\b"):
        layer(jnp.ones(c["lead"] + (width,)))

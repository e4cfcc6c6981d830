"""The token mask and the capacity factor of `MoEFFN`, against a float64 per-token loop that
applies them by their definition (GShard's slot-then-token order), and against the layer run
on the real tokens alone."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from cmoe_jax.moe import HierMoEFFN, MoEFFN
from cmoe_jax.moe.token_pairs import capacity, kept_pairs

D, M, E, S = 16, 8, 6, 12


def silu(z):
    return z / (1.0 + np.exp(-z))


def reference(layer, x, mask, factor):
    """(y, loads, dropped share): softmax top-k routing, then the capacity applied pair by
    pair, first slots first, in token order, masked tokens skipped."""
    p = {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(nnx.state(layer)).items()}
    x = np.asarray(x, np.float64)
    tokens, k = x.shape[0], layer.top_k
    z = x @ p["router_kernel"]
    probs = np.exp(z - z.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    limit = max(1, min(tokens, int(np.ceil(factor * tokens * k / E)))) if factor > 0 else tokens
    used, keep = np.zeros(E, int), np.zeros((tokens, k), bool)
    for j in range(k):
        for t in range(tokens):
            if mask[t] and used[ids[t, j]] < limit:
                used[ids[t, j]] += 1
                keep[t, j] = True
    y = np.zeros_like(x)
    for t in range(tokens):
        if "shared_gate" in p:
            y[t] += (silu(x[t] @ p["shared_gate"]) * (x[t] @ p["shared_up"])) @ p["shared_down"]
        for j in np.flatnonzero(keep[t]):
            e = ids[t, j]
            h = silu(x[t] @ p["expert_gate"][e]) * (x[t] @ p["expert_up"][e])
            y[t] += probs[t, e] * (h @ p["expert_down"][e])
    live = np.broadcast_to(np.asarray(mask)[:, None], keep.shape)
    return y, used, (live & ~keep).sum() / max(live.sum(), 1)


def layer_of(factor=0.0, shared=S, **kw):
    return MoEFFN(d_model=D, expert_width=M, num_experts=E, top_k=2, shared_width=shared,
                  capacity_factor=factor, activation="silu", rngs=nnx.Rngs(0), **kw)


def inputs(n=24, seed=1, masked=(3, 4, 10, 23)):
    x = np.random.default_rng(seed).normal(size=(n, D)).astype(np.float32)
    mask = np.ones(n, bool)
    mask[list(masked)] = False
    return x, mask


@pytest.mark.parametrize("dispatch", ["sort", "gather", "dense"])
@pytest.mark.parametrize("factor", [0.0, 0.5, 1.0, 1.25])
def test_mask_and_capacity_match_the_definition(dispatch, factor):
    layer = layer_of(factor, dispatch=dispatch)
    x, mask = inputs()
    y, load, r = layer(jnp.asarray(x), mask=jnp.asarray(mask), return_load=True, return_router=True)
    want, want_load, want_dropped = reference(layer, x, mask, factor)
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(np.asarray(load), want_load)
    np.testing.assert_array_equal(np.asarray(r.load), want_load)
    np.testing.assert_allclose(float(r.dropped), want_dropped, atol=1e-6)
    if factor == 0.5:
        assert float(r.dropped) > 0  # the case that drops


def test_masked_tokens_count_nowhere_and_real_tokens_are_as_if_alone():
    """A masked token's output is the shared MLP's; loads, Switch and z losses equal those of
    the real tokens run alone; with no shared MLP padding comes out as zeros."""
    layer = layer_of()
    x, mask = inputs()
    y, load, r = layer(jnp.asarray(x), mask=jnp.asarray(mask), return_load=True, return_router=True)
    alone, alone_load, ra = layer(jnp.asarray(x[mask]), return_load=True, return_router=True)
    np.testing.assert_allclose(np.asarray(y)[mask], np.asarray(alone), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(y)[~mask], np.asarray(layer.shared(jnp.asarray(x[~mask]))), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(load), np.asarray(alone_load))
    for got, want in [(r.aux_loss, ra.aux_loss), (r.z_loss, ra.z_loss)]:
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    bare = layer_of(shared=0)
    assert not np.asarray(bare(jnp.asarray(x), mask=jnp.asarray(mask))[~mask]).any()


def test_a_batch_shaped_mask_and_gradients_skip_padding():
    layer = layer_of(1.0)
    x, mask = inputs()
    xb, mb = jnp.asarray(x).reshape(4, 6, D), jnp.asarray(mask).reshape(4, 6)
    np.testing.assert_allclose(np.asarray(layer(xb, mask=mb)).reshape(-1, D),
                               np.asarray(layer(jnp.asarray(x), mask=jnp.asarray(mask))), atol=1e-6)
    bare = layer_of(1.0, shared=0)
    grad = jax.grad(lambda v: jnp.sum(bare(v, mask=mb) ** 2))(xb)
    assert not np.asarray(grad).reshape(-1, D)[~mask].any()  # padding gets no gradient
    with pytest.raises(ValueError, match=r"mask must have the input's leading shape \(4, 6\)"):
        layer(xb, mask=jnp.ones((24,), bool))


def test_capacity_under_jit_with_lora_adapters_matches_merged_weights():
    """Adapters ride on the same grouped matmuls: a dropped pair gets no adapter output either."""
    from cmoe_jax.lora_variables import attach

    layer = layer_of(0.75, router_balance=True)
    layer.router_bias[...] = jnp.linspace(-0.3, 0.3, E)
    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(E, D, 2)) * 0.3, rng.normal(size=(E, 2, M)) * 0.3
    x, mask = inputs()
    attach(layer, "expert_up", a, b, scale=0.5)
    got = nnx.jit(lambda m, v, k: m(v, mask=k))(layer, jnp.asarray(x), jnp.asarray(mask))
    merged = layer_of(0.75, router_balance=True)
    merged.router_bias[...] = layer.router_bias[...]
    nnx.update(merged, nnx.state(layer, nnx.Param))
    merged.expert_up[...] = layer.expert_up[...] + 0.5 * jnp.einsum("edr,erm->edm", a, b)
    np.testing.assert_allclose(np.asarray(got), np.asarray(merged(jnp.asarray(x), mask=jnp.asarray(mask))),
                               rtol=2e-4, atol=2e-4)


def test_prototype_and_hierarchical_layers_take_the_mask():
    x, mask = inputs()
    conmoe = layer_of(num_prototypes=3)
    y, load = conmoe(jnp.asarray(x), mask=jnp.asarray(mask), return_load=True)
    alone, alone_load = conmoe(jnp.asarray(x[mask]), return_load=True)
    np.testing.assert_allclose(np.asarray(y)[mask], np.asarray(alone), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(load), np.asarray(alone_load))

    hier = HierMoEFFN(d_model=D, expert_width=4, num_experts=4, top_k=2, shared_width=S, router="cmoe",
                      sub_experts=4, sub_shared=1, sub_top_k=1, activation="silu", rngs=nnx.Rngs(0))
    y, load = hier(jnp.asarray(x), mask=jnp.asarray(mask), return_load=True)
    alone, alone_load = hier(jnp.asarray(x[mask]), return_load=True)
    np.testing.assert_allclose(np.asarray(y)[mask], np.asarray(alone), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(load), np.asarray(alone_load))


def test_a_hierarchical_layer_caps_each_sub_expert():
    """The capacity factor of a hierarchical layer caps each stored sub-expert's rows as a
    plain layer's experts: ceil(c * T * k' / E') pairs, slot by slot, then token by token."""
    hier = HierMoEFFN(d_model=D, expert_width=4, num_experts=4, top_k=2, router="cmoe", sub_experts=4,
                      sub_shared=1, sub_top_k=1, capacity_factor=0.5, activation="silu", rngs=nnx.Rngs(0))
    x, _ = inputs()
    ids, w = (np.asarray(a) for a in hier.route(jnp.asarray(x)))  # [T, k'] rows and weights
    (t_count, k), rows = ids.shape, hier.num_experts
    limit, used, keep = math.ceil(0.5 * t_count * k / rows), np.zeros(rows, int), np.zeros(ids.shape, bool)
    for j in range(k):
        for t in range(t_count):
            if used[ids[t, j]] < limit:
                keep[t, j], used[ids[t, j]] = True, used[ids[t, j]] + 1
    assert not keep.all()  # the case that drops
    p = {n: np.asarray(getattr(hier, n)[...], np.float64) for n in ("expert_gate", "expert_up", "expert_down")}
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    want = np.zeros(x.shape)
    for t, j in zip(*np.nonzero(keep)):
        e = ids[t, j]
        want[t] += w[t, j] * (silu(x[t] @ p["expert_gate"][e]) * (x[t] @ p["expert_up"][e])) @ p["expert_down"][e]
    y, load = hier(jnp.asarray(x), return_load=True)
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(np.asarray(load), used.reshape(-1, 4)[:, 1:])


def test_a_negative_capacity_factor_is_refused():
    with pytest.raises(ValueError, match=r"capacity_factor=-1.0 must be >= 0"):
        layer_of(-1.0)


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 12), top_k=st.integers(1, 3), experts=st.integers(3, 5),
       factor=st.sampled_from([0.0, 0.3, 0.5, 1.0, 2.0]), seed=st.integers(0, 10_000))
def test_kept_pairs_is_the_greedy_slot_then_token_rule(tokens, top_k, experts, factor, seed):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)])
    mask = rng.random(tokens) < 0.8
    limit = capacity(tokens, top_k, experts, factor)
    used, want = np.zeros(experts, int), np.zeros(ids.shape, bool)
    for j in range(top_k):
        for t in range(tokens):
            if mask[t] and used[ids[t, j]] < limit:
                used[ids[t, j]] += 1
                want[t, j] = True
    got = kept_pairs(jnp.asarray(ids, jnp.int32), experts, jnp.asarray(mask), factor)
    np.testing.assert_array_equal(np.asarray(got), want)

"""`carve_ffn`: a user's own dense FFN carved into a filled `MoEFFN` in one call; with every
expert active it is the dense FFN (numpy recomputation), sparse it matches the per-token
numpy reference of the layer, and bad arguments are refused before any work."""
import numpy as np
import pytest

import jax.numpy as jnp

from cmoe_jax import carve_ffn
from cmoe_jax.methods.cmoe import MoEPlan
from tests import moe_numpy

D, DH = 24, 96


def dense_ffn(rng_seed=0):
    rng = np.random.default_rng(rng_seed)
    w = [rng.normal(size=s).astype(np.float32) * 0.3 for s in ((D, DH), (D, DH), (DH, D))]
    x = rng.normal(size=(3, 40, D)).astype(np.float32)
    return w, x


def numpy_dense(w, x):
    g, u = x.astype(np.float64) @ w[0], x.astype(np.float64) @ w[1]
    return (moe_numpy.silu(g) * u) @ w[2]


@pytest.mark.parametrize("plan", ["S1A2E8", "S0A1E4", "S2A3E6"])
def test_every_expert_active_is_the_dense_ffn(plan):
    w, x = dense_ffn()
    moe, carving = carve_ffn(*w, x, plan, activation="silu", return_carving=True, router_neurons=2, gate_fit=False,
                             down_fit=0.0)
    p = MoEPlan.parse(plan)
    assert (moe.num_experts, moe.top_k, moe.router) == (p.routed, p.active, "cmoe")
    assert moe.shared_width == p.shared_width(DH) and moe.expert_width == DH // p.total
    ids = np.sort(np.concatenate([carving.shared_idx, carving.expert_idx.ravel()]))
    np.testing.assert_array_equal(ids, np.arange(DH))
    moe.top_k = moe.num_experts
    np.testing.assert_allclose(np.asarray(moe(jnp.asarray(x))), numpy_dense(w, x), rtol=1e-4, atol=1e-4)


def test_the_sparse_layer_routes_as_the_numpy_reference():
    w, x = dense_ffn(1)
    moe = carve_ffn(*w, x, "S1A2E8", activation="silu")
    flat = x.reshape(-1, D)
    want, load, _ = moe_numpy.forward(moe, flat)
    y, counts = moe(jnp.asarray(flat), return_load=True)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(counts), load)


def test_router_scales_are_fitted_unless_asked_not_to():
    w, x = dense_ffn(2)
    fitted = carve_ffn(*w, x, "S1A2E8", activation="silu", router_neurons=2)
    plain = carve_ffn(*w, x, "S1A2E8", activation="silu", router_neurons=2, router_scale=False)
    np.testing.assert_array_equal(np.asarray(fitted.router_gate[...]), np.asarray(plain.router_gate[...]))
    assert not np.allclose(np.asarray(fitted.router_up[...]), np.asarray(plain.router_up[...]))


def test_dtype_follows_the_weights():
    w, x = dense_ffn(3)
    moe = carve_ffn(*(jnp.asarray(a, jnp.bfloat16) for a in w), x, "S1A1E4", activation="silu")
    assert moe.expert_gate[...].dtype == jnp.bfloat16 and moe.dtype == jnp.bfloat16
    assert moe(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16


@pytest.mark.parametrize("change, message", [
    (dict(plan="S1A2E7"), "do not divide"),
    (dict(plan="S1A8E8"), "exceed"),
    (dict(plan="1-2-8"), "SxAyEz"),
    (dict(x=np.zeros((0, D), np.float32)), "no token"),
    (dict(x=np.zeros((5, D + 1), np.float32)), r"\[\.\.\., d=24\]"),
    (dict(w_down=np.zeros((D, DH), np.float32)), r"\[d, d_h\], \[d, d_h\], \[d_h, d\]"),
    (dict(router_neurons=13), "router_neurons 13"),
    (dict(bogus=1), "unknown carve_ffn option"),
    (dict(backend="cuda"), "unknown gmm backend"),
    (dict(activation="relu"), "activation 'relu' is not one of"),
    (dict(x=np.zeros((1, 4, D), np.float32)), "4 tokens, fewer than the plan's 8 experts"),
    (dict(x=np.full((5, 8, D), np.nan, np.float32)), "NaN or infinite"),
])
def test_bad_arguments_are_refused_with_one_line(change, message):
    w, x = dense_ffn()
    args = dict(w_gate=w[0], w_up=w[1], w_down=w[2], x=x, plan="S1A2E8")
    args.update(change)
    w_gate, w_up, w_down, x, plan = (args.pop(k) for k in ("w_gate", "w_up", "w_down", "x", "plan"))
    with pytest.raises(ValueError, match=message) as err:
        carve_ffn(w_gate, w_up, w_down, x, plan, **{"activation": "silu", **args})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("plan", ["S1A2E8", "S2A1E6"])
def test_gate_fit_is_the_least_squares_gate_scaling(plan):
    """u of the gates 1 + s'u, fitted at conversion, equals numpy's least-squares solution
    built from the carved experts run one by one, and lowers the layer's squared error on the
    calibration tokens against the dense FFN."""
    w, x = dense_ffn(3)
    moe = carve_ffn(*w, x, plan, activation="silu", gate_fit=True, router_fit_tokens=10_000, down_fit=0.0)
    u = np.asarray(moe.u[...], np.float64)
    t = x.reshape(-1, D).astype(np.float64)
    act = moe_numpy.silu
    rg, ru = (np.asarray(getattr(moe, n)[...], np.float64) for n in ("router_gate", "router_up"))
    scores = np.abs(act(t @ rg) * (t @ ru)).reshape(len(t), moe.num_experts, -1).sum(-1)
    probs = np.exp(scores - scores.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    chosen = np.zeros_like(probs, bool)
    np.put_along_axis(chosen, np.argsort(-probs, 1, kind="stable")[:, :moe.top_k], True, 1)
    eg, eu, ed = (np.asarray(getattr(moe, "expert_" + n)[...], np.float64) for n in ("gate", "up", "down"))
    outs = np.stack([(act(t @ eg[e]) * (t @ eu[e])) @ ed[e] for e in range(moe.num_experts)], 1)
    a = np.where(chosen[..., None], probs[..., None] * outs, 0.0)          # [T, E, d]
    missing = np.where(chosen[..., None], 0.0, outs).sum(1)
    design = a.transpose(0, 2, 1).reshape(-1, moe.num_experts)
    expected = np.linalg.lstsq(design, missing.reshape(-1), rcond=None)[0]
    np.testing.assert_allclose(u, expected, rtol=2e-3, atol=2e-3 * np.abs(expected).max())
    dense = numpy_dense(w, x)
    fitted = np.square(np.asarray(moe(jnp.asarray(x)), np.float64) - dense).sum()
    moe.u[...] = jnp.zeros_like(moe.u[...])
    plain = np.square(np.asarray(moe(jnp.asarray(x)), np.float64) - dense).sum()
    assert fitted < plain


def _neuron_features(moe, t):
    """P [T, H] of a carved layer, token by token in float64: the shared neurons' h, then each
    expert's neurons' h times the token's gate on it (0 for an expert the token skips)."""
    p = moe_numpy.params(moe)
    act, e = moe_numpy.silu, moe.num_experts
    rows = []
    for xt in t:
        probs = moe_numpy.softmax(moe_numpy.logits(p, xt, "cmoe", e))
        sel = np.argsort(-(probs + p["router_bias"]), kind="stable")[:moe.top_k]
        gate = np.zeros(e)
        gate[sel] = 1.0 + probs[sel] * p["u"][sel]
        shared = act(xt @ p["shared_gate"]) * (xt @ p["shared_up"]) if "shared_gate" in p else np.zeros(0)
        routed = [gate[j] * act(xt @ p["expert_gate"][j]) * (xt @ p["expert_up"][j]) for j in range(e)]
        rows.append(np.concatenate([shared, *routed]))
    return np.stack(rows)


def down_rows(moe) -> np.ndarray:
    """The layer's down projections, shared rows first, float64 [H, d]."""
    shared = [np.asarray(moe.shared_down[...], np.float64)] if moe.shared_width else []
    return np.concatenate(shared + [np.asarray(moe.expert_down[...], np.float64).reshape(-1, D)])


def assert_ridge_down(moe, carved, feats, y, ridge: float) -> None:
    """`moe`'s down projections equal numpy's ridge solution of y = P W over the features
    P [T, H], pulled towards `carved`'s rows."""
    gram = feats.T @ feats
    lam = ridge * np.mean(np.diag(gram))
    want = np.linalg.solve(gram + lam * np.eye(len(gram)), feats.T @ y + lam * down_rows(carved))
    np.testing.assert_allclose(down_rows(moe), want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


@pytest.mark.parametrize("plan, ridge", [("S1A2E8", 0.01), ("S0A1E4", 0.1), ("S2A3E6", 1e-3)])
def test_down_fit_is_the_ridge_least_squares_reconstruction(plan, ridge):
    """The refitted down projections equal numpy's ridge solution (pulled towards the
    carved rows) built token by token from the layer's own routing, and make the layer's
    output on the calibration tokens closer to the dense FFN's."""
    w, x = dense_ffn(4)
    carved = carve_ffn(*w, x, plan, activation="silu", down_fit=0.0)
    moe = carve_ffn(*w, x, plan, activation="silu", down_fit=ridge, down_fit_tokens=10_000)
    for name in ("router_gate", "router_up", "u", "expert_gate", "expert_up"):
        np.testing.assert_array_equal(np.asarray(getattr(moe, name)[...]), np.asarray(getattr(carved, name)[...]))
    feats = _neuron_features(carved, x.reshape(-1, D).astype(np.float64))
    assert_ridge_down(moe, carved, feats, numpy_dense(w, x).reshape(-1, D), ridge)
    dense = numpy_dense(w, x)
    error = lambda layer: np.square(np.asarray(layer(jnp.asarray(x)), np.float64) - dense).sum()  # noqa: E731
    assert error(moe) < error(carved)


def test_down_fit_zero_keeps_the_dense_rows():
    w, x = dense_ffn(5)
    moe, carving = carve_ffn(*w, x, "S1A2E8", activation="silu", down_fit=0.0, return_carving=True)
    np.testing.assert_array_equal(np.asarray(moe.shared_down[...]), w[2][carving.shared_idx])
    np.testing.assert_array_equal(np.asarray(moe.expert_down[...]), w[2][carving.expert_idx])

"""carve_layer / slice_ffn: partition, shared = top mu, representatives, router, and the
dense FFN reproduced exactly with every expert active."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from scipy.spatial.distance import cdist

from cmoe_jax.methods.cmoe import LayerCarving, MoEPlan, carve_layer, slice_ffn
from cmoe_jax.calibration_pass.markers import profile_layer


def _layer(seed=0, d=16, d_h=64, tokens=300):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(tokens, d)), rng.normal(size=(d, d_h)), rng.normal(size=(d, d_h)),
            rng.normal(size=(d_h, d)))


def _swiglu(x, g, u, dn):
    a = x @ g
    return (a / (1 + np.exp(-a)) * (x @ u)) @ dn


@pytest.mark.parametrize("config, iters", [("S2A3E8", None), ("S1A1E8", 1), ("S0A2E4", None), ("S3A9E16", 2)])
def test_carving_partition_and_dense_equivalence(config, iters):
    x, wg, wu, wd = _layer()
    plan = MoEPlan.parse(config)
    markers, mu = map(np.asarray, profile_layer(x, wg, wu, wd, k_act=6, activation="silu")[:2])
    c = carve_layer(markers, mu, plan, k_act=6, kmeans_iters=iters)
    m, nr = 64 // plan.total, plan.routed
    assert c.shared_idx.shape == (plan.shared * m,) and c.expert_idx.shape == (nr, m)
    assert c.representative_idx.shape == (nr, 1)
    assert sorted(np.concatenate([c.shared_idx, c.expert_idx.ravel()]).tolist()) == list(range(64))
    assert set(c.shared_idx.tolist()) == set(np.argsort(-mu, kind="stable")[: plan.shared * m].tolist())
    assert all((np.diff(row) > 0).all() for row in c.expert_idx)
    if iters is not None:
        assert c.iterations <= iters
    assert set(c.timings) >= {"shared", "kmeans", "assignment", "representatives", "total"}

    s = slice_ffn(wg, wu, wd, c)
    shapes = {"shared_gate": (16, plan.shared * m), "shared_up": (16, plan.shared * m),
              "shared_down": (plan.shared * m, 16), "expert_gate": (nr, 16, m), "expert_up": (nr, 16, m),
              "expert_down": (nr, m, 16), "router_gate": (16, nr), "router_up": (16, nr)}
    assert {k: v.shape for k, v in s.items()} == shapes
    total = _swiglu(x, s["shared_gate"], s["shared_up"], s["shared_down"]) + sum(
        _swiglu(x, s["expert_gate"][e], s["expert_up"][e], s["expert_down"][e]) for e in range(nr))
    np.testing.assert_allclose(total, _swiglu(x, wg, wu, wd), rtol=1e-10, atol=1e-10)
    for e in range(nr):  # each expert really holds its neurons
        np.testing.assert_array_equal(s["expert_gate"][e], wg[:, c.expert_idx[e]])
        np.testing.assert_array_equal(s["expert_down"][e], wd[c.expert_idx[e], :])
    # router: the representatives' unit-normed columns
    r = c.representative_idx.reshape(-1)
    np.testing.assert_allclose(s["router_gate"], wg[:, r] / np.linalg.norm(wg[:, r], axis=0), rtol=1e-6)
    np.testing.assert_allclose(s["router_up"], wu[:, r] / np.linalg.norm(wu[:, r], axis=0), rtol=1e-6)


def test_representatives_closest_to_member_mean():
    x, wg, wu, wd = _layer(1, d_h=96, tokens=500)
    markers, mu = map(np.asarray, profile_layer(x, wg, wu, wd, k_act=8, activation="silu")[:2])
    c = carve_layer(markers, mu, MoEPlan.parse("S1A2E6"), k_act=8)
    cols = markers.astype(float).T                       # neuron points [d_h, T]
    for e, rep in zip(c.expert_idx, c.representative_idx):
        d = cdist(cols[e], cols[e].mean(axis=0, keepdims=True), "sqeuclidean")[:, 0]
        best = e[np.flatnonzero(np.isclose(d, d.min(), rtol=0, atol=1e-9))]
        assert rep.tolist() == [best.min()]              # closest, lowest id on ties


def test_several_router_neurons_are_the_closest_members_in_order():
    x, wg, wu, wd = _layer(1, d_h=96, tokens=500)
    markers, mu = map(np.asarray, profile_layer(x, wg, wu, wd, k_act=8, activation="silu")[:2])
    c = carve_layer(markers, mu, MoEPlan.parse("S1A2E6"), k_act=8, router_neurons=3)
    assert c.representative_idx.shape == (5, 3)
    cols = markers.astype(float).T
    for e, reps in zip(c.expert_idx, c.representative_idx):
        d = cdist(cols[e], cols[e].mean(axis=0, keepdims=True), "sqeuclidean")[:, 0]
        order = sorted(range(len(e)), key=lambda i: (round(d[i], 9), e[i]))  # distance, then id
        assert reps.tolist() == [int(e[i]) for i in order[:3]]
    s = slice_ffn(wg, wu, wd, c)                         # expert-major router columns
    assert s["router_gate"].shape == (16, 15)
    np.testing.assert_allclose(s["router_gate"][:, 3:6], wg[:, c.representative_idx[1]]
                               / np.linalg.norm(wg[:, c.representative_idx[1]], axis=0), rtol=1e-6)
    with pytest.raises(ValueError, match="router neurons"):
        carve_layer(markers, mu, MoEPlan.parse("S1A2E6"), k_act=8, router_neurons=17)


def test_shared_ties_break_by_index():
    markers = np.zeros((8, 16), bool)
    markers[:, [3, 5]] = True                            # tie at rate 1
    markers[:4, 9] = markers[4:, 12] = markers[:4, 1] = markers[4:, 14] = True
    mu = markers.mean(axis=0)
    c = carve_layer(markers, mu, MoEPlan.parse("S1A1E4"), k_act=3)
    np.testing.assert_array_equal(c.shared_idx, [1, 3, 5, 9])   # 3, 5 then the 0.5s: 1 < 9 < 12 < 14


def test_shared_by_score_and_centroids_by_mu():
    from cmoe_jax.methods.cmoe import split_shared

    mu = np.array([0.9, 0.1, 0.8, 0.3, 0.3, 0.7])
    score = np.array([0.0, 5.0, 1.0, 5.0, 2.0, 0.5])
    shared, rest, init = split_shared(mu, 2, 2, score)
    np.testing.assert_array_equal(shared, [1, 3])         # top score, tie 1 < 3
    np.testing.assert_array_equal(rest, [0, 2, 4, 5])
    np.testing.assert_array_equal(init, [0, 2])           # highest mu among the rest
    shared, rest, init = split_shared(mu, 2, 2)           # the paper's rule: by mu
    np.testing.assert_array_equal(shared, [0, 2])
    np.testing.assert_array_equal(init, [5, 3])           # 0.7, then the 0.3 tie: 3 < 4
    with pytest.raises(ValueError, match="shared score"):
        split_shared(mu, 2, 2, score[:3])


def test_deterministic_bit_for_bit():
    x, wg, wu, wd = _layer(4, d_h=128, tokens=400)
    markers, mu = map(np.asarray, profile_layer(x, wg, wu, wd, k_act=5, activation="silu")[:2])
    a = carve_layer(markers, mu, MoEPlan.parse("S1A2E8"), k_act=5)
    b = carve_layer(markers.copy(), mu.copy(), MoEPlan.parse("S1A2E8"), k_act=5)
    for f in ("shared_idx", "expert_idx", "representative_idx"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    assert a.iterations == b.iterations and a.kmeans_costs == b.kmeans_costs
    sa, sb = slice_ffn(wg, wu, wd, a), slice_ffn(wg, wu, wd, b)
    assert all(np.array_equal(sa[k], sb[k]) for k in sa)


def test_slice_ffn_accepts_jax_bf16():
    x, wg, wu, wd = _layer(5)
    markers, mu = map(np.asarray, profile_layer(x, wg, wu, wd, k_act=6, activation="silu")[:2])
    c = carve_layer(markers, mu, MoEPlan.parse("S2A2E8"), k_act=6)
    ref = slice_ffn(wg.astype(np.float32), wu.astype(np.float32), wd.astype(np.float32), c)
    out = slice_ffn(*(jnp.asarray(w, jnp.bfloat16) for w in (wg, wu, wd)), c)
    for k, v in out.items():
        assert v.dtype == jnp.bfloat16 and v.shape == ref[k].shape
        np.testing.assert_allclose(np.asarray(v, np.float32), ref[k], rtol=1e-2, atol=1e-2)
    raw = slice_ffn(wg, wu, wd, c, normalize_router=False)
    np.testing.assert_array_equal(raw["router_gate"], wg[:, c.representative_idx.ravel()])
    np.testing.assert_array_equal(raw["router_up"], wu[:, c.representative_idx.ravel()])


def test_layer_carving_minimal_construction_and_errors():
    c = LayerCarving(np.arange(2), np.arange(6).reshape(2, 3) + 2, np.array([2, 5]), iterations=3)
    assert c.timings == {} and dataclasses.asdict(c)["iterations"] == 3
    markers = np.zeros((10, 16), bool)
    markers[:, :2] = True
    with pytest.raises(ValueError, match="mu"):
        carve_layer(markers, np.zeros(15), MoEPlan.parse("S1A1E4"), k_act=2)
    with pytest.raises(ValueError, match="divide"):
        carve_layer(markers, markers.mean(0), MoEPlan.parse("S1A1E5"), k_act=2)
    with pytest.raises(ValueError, match="permutation"):
        slice_ffn(np.zeros((4, 16)), np.zeros((4, 16)), np.zeros((16, 4)),
                  LayerCarving(np.arange(2), np.arange(2, 14).reshape(2, 6), np.array([2, 8])))
    with pytest.raises(ValueError, match="permutation"):
        slice_ffn(np.zeros((4, 14)), np.zeros((4, 14)), np.zeros((14, 4)),
                  LayerCarving(np.arange(2), np.arange(1, 13).reshape(2, 6), np.array([2, 8])))
    with pytest.raises(ValueError, match=r"\[d, d_h\]"):
        slice_ffn(np.zeros((4, 14)), np.zeros((4, 14)), np.zeros((4, 14)),
                  LayerCarving(np.arange(2), np.arange(2, 14).reshape(2, 6), np.array([2, 8])))

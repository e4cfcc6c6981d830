"""Carving math against independent references: LSA on the repeated-column matrix,
brute force on tiny inputs, and the dense FFN."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from cmoe_jax.carving import (MoEPlan, assignment_cost, balanced_assignment, balanced_kmeans,
                              carve_layer, profile_markers, repeated_column_reference, slice_ffn)


@pytest.mark.parametrize("seed", range(40))
def test_assignment_matches_lsa_on_repeated_columns(seed):
    rng = np.random.default_rng(seed)
    k, m = int(rng.integers(1, 7)), int(rng.integers(1, 9))
    if seed % 3 == 0:
        cost = rng.integers(0, 3, size=(k * m, k)).astype(float)  # many ties
    elif seed % 3 == 1:
        cost = np.repeat(rng.random((k * m, 1)), k, axis=1)        # every point indifferent
    else:
        cost = rng.normal(size=(k * m, k))
    ours = balanced_assignment(cost)
    assert np.bincount(ours, minlength=k).tolist() == [m] * k
    ref = repeated_column_reference(cost)
    assert assignment_cost(cost, ours) == pytest.approx(assignment_cost(cost, ref), abs=1e-9)


def test_assignment_brute_force_tiny():
    rng = np.random.default_rng(1)
    for _ in range(20):
        cost = rng.integers(0, 5, size=(6, 3)).astype(float)
        best = min(sum(cost[i, l] for i, l in enumerate(labels))
                   for labels in itertools.product(range(3), repeat=6)
                   if all(labels.count(j) == 2 for j in range(3)))
        assert assignment_cost(cost, balanced_assignment(cost)) == best


def test_kmeans_balanced_and_monotone():
    rng = np.random.default_rng(0)
    points = (rng.random((48, 200)) < rng.random((48, 1)) * 0.3).astype(np.float32)
    km = balanced_kmeans(points, init=np.arange(4))
    assert np.bincount(km.labels, minlength=4).tolist() == [12] * 4
    assert all(b <= a + 1e-9 for a, b in zip(km.costs, km.costs[1:]))
    one = balanced_kmeans(points, init=np.arange(4), max_iters=1)
    assert one.iterations == 1


def test_markers_top_k_and_rates():
    rng = np.random.default_rng(0)
    x, wg, wu = rng.normal(size=(50, 8)), rng.normal(size=(8, 20)), rng.normal(size=(8, 20))
    markers, mu = profile_markers(x, wg, wu, k_act=3, normalize=False)
    markers = np.asarray(markers)
    h = np.abs(x @ wg / (1 + np.exp(-(x @ wg))) * (x @ wu))
    expected = np.zeros_like(markers)
    np.put_along_axis(expected, np.argsort(-h, axis=1)[:, :3], True, axis=1)
    np.testing.assert_array_equal(markers, expected)
    np.testing.assert_allclose(np.asarray(mu), expected.mean(axis=0), atol=1e-7)


def test_carving_partition_shared_top_mu_and_dense_equivalence():
    rng = np.random.default_rng(0)
    d, d_h, tokens = 16, 64, 300
    x, wg, wu, wd = (rng.normal(size=(tokens, d)), rng.normal(size=(d, d_h)),
                     rng.normal(size=(d, d_h)), rng.normal(size=(d_h, d)))
    markers, mu = map(np.asarray, profile_markers(x, wg, wu, k_act=6))
    plan = MoEPlan.parse("S2A3E8")
    c = carve_layer(markers, mu, plan, k_act=6)
    assert sorted(np.concatenate([c.shared_idx, c.expert_idx.ravel()]).tolist()) == list(range(d_h))
    assert set(c.shared_idx.tolist()) == set(np.argsort(-mu, kind="stable")[:16].tolist())
    assert all(r in e for r, e in zip(c.representative_idx, c.expert_idx))
    s = slice_ffn(wg, wu, wd, c)

    def swiglu(g, u, dn):
        a = x @ g
        return (a / (1 + np.exp(-a)) * (x @ u)) @ dn

    total = swiglu(s["shared_gate"], s["shared_up"], s["shared_down"]) + sum(
        swiglu(s["expert_gate"][e], s["expert_up"][e], s["expert_down"][e]) for e in range(6))
    np.testing.assert_allclose(total, swiglu(wg, wu, wd), rtol=1e-9, atol=1e-9)
    again = carve_layer(markers, mu, plan, k_act=6)
    np.testing.assert_array_equal(again.expert_idx, c.expert_idx)


@pytest.mark.parametrize("config, d_h, k_act, message", [
    ("S1A1E7", 64, 4, "divide"), ("S1A8E8", 64, 4, "exceed"), ("S8A1E8", 64, 4, "fewer than"),
    ("S1A1E8", 64, 65, "K_a"),
])
def test_plan_validation(config, d_h, k_act, message):
    with pytest.raises(ValueError, match=message):
        MoEPlan.parse(config).validate(d_h, k_act)


def test_plan_parse():
    p = MoEPlan.parse("S3A9E16")
    assert (p.shared, p.active, p.total, p.routed, p.expert_width(11008)) == (3, 9, 16, 13, 688)
    with pytest.raises(ValueError, match="SxAyEz"):
        MoEPlan.parse("E8")

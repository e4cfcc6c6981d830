"""Exact balanced assignment vs independent references: scipy's linear_sum_assignment on the
papers' repeated-column matrix, and brute force over every balanced partition."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from cmoe_jax.carving import assignment_cost, balanced_assignment, repeated_column_reference


def _random_cost(rng, kind, n, k):
    if kind == "ints":            # many ties
        return rng.integers(0, 3, size=(n, k)).astype(float)
    if kind == "rows_equal":      # every point indifferent
        return np.repeat(rng.random((n, 1)), k, axis=1)
    if kind == "cols_equal":      # every cluster alike
        return np.repeat(rng.random((1, k)), n, axis=0)
    if kind == "constant":
        return np.full((n, k), 7.0)
    if kind == "hamming":         # integer distances of binary points, as in K-means step 1
        pts = rng.random((n, 30)) < 0.2
        cen = pts[rng.choice(n, k, replace=False)]
        return (pts[:, None, :] != cen[None, :, :]).sum(-1).astype(float)
    if kind == "rank1":           # like co-activation counts: c_ij = -a_i b_j, with ties
        return -np.outer(rng.integers(0, 4, n), rng.integers(0, 4, k)).astype(float)
    return rng.normal(size=(n, k))


KINDS = ["ints", "rows_equal", "cols_equal", "constant", "hamming", "rank1", "normal"]


@pytest.mark.parametrize("seed", range(70))
def test_matches_lsa_on_repeated_columns(seed):
    rng = np.random.default_rng(seed)
    k, m = int(rng.integers(1, 8)), int(rng.integers(1, 10))
    cost = _random_cost(rng, KINDS[seed % len(KINDS)], k * m, k)
    ours = balanced_assignment(cost)
    assert ours.dtype == np.int64 and ours.min() >= 0 and ours.max() < k
    assert np.bincount(ours, minlength=k).tolist() == [m] * k
    ref = repeated_column_reference(cost)
    assert assignment_cost(cost, ours) == pytest.approx(assignment_cost(cost, ref), abs=1e-9)


@pytest.mark.parametrize("seed", range(9))
def test_matches_lsa_larger(seed):
    rng = np.random.default_rng(100 + seed)
    k, m = [(5, 40), (7, 30), (3, 100), (12, 10), (2, 150), (16, 8), (30, 6), (40, 3), (7, 60)][seed]
    kind = ["ints", "hamming", "normal", "rank1"][seed % 4]
    cost = _random_cost(rng, kind, k * m, k)
    if kind == "ints":
        cost = rng.integers(0, 20, size=cost.shape).astype(float)
    if seed == 8:                 # increasing rank-1: index-order insertion would chain every point
        cost = np.outer(np.arange(k * m), np.arange(k)) / (k * m)
    ours = balanced_assignment(cost)
    assert np.bincount(ours, minlength=k).tolist() == [m] * k
    assert assignment_cost(cost, ours) == pytest.approx(assignment_cost(cost, repeated_column_reference(cost)),
                                                        rel=1e-12, abs=1e-9)


@pytest.mark.parametrize("seed", range(10))
def test_capacity_slack_matches_rectangular_lsa(seed):
    rng = np.random.default_rng(200 + seed)
    k, cap = int(rng.integers(2, 6)), int(rng.integers(2, 8))
    n = int(rng.integers(1, k * cap + 1))
    cost = rng.integers(-3, 4, size=(n, k)).astype(float)
    ours = balanced_assignment(cost, capacity=cap)
    assert np.bincount(ours, minlength=k).max() <= cap
    ref = repeated_column_reference(cost, capacity=cap)
    assert assignment_cost(cost, ours) == assignment_cost(cost, ref)


def _brute_force(cost, m):
    n, k = cost.shape
    best = np.inf
    for labels in itertools.product(range(k), repeat=n):
        if all(labels.count(j) == m for j in range(k)):
            best = min(best, sum(cost[i, l] for i, l in enumerate(labels)))
    return best


@pytest.mark.parametrize("shape", [(6, 3), (6, 2), (8, 4), (8, 2), (9, 3), (4, 4)])
def test_brute_force_tiny(shape):
    rng = np.random.default_rng(shape[0] * 10 + shape[1])
    n, k = shape
    for trial in range(8):
        cost = rng.integers(0, 4, size=shape).astype(float) if trial % 2 else rng.normal(size=shape)
        ours = balanced_assignment(cost)
        assert np.bincount(ours, minlength=k).tolist() == [n // k] * k
        assert assignment_cost(cost, ours) == pytest.approx(_brute_force(cost, n // k), abs=1e-12)


def test_deterministic_and_dtype_independent():
    rng = np.random.default_rng(7)
    cost = rng.integers(0, 5, size=(600, 6))
    a = balanced_assignment(cost)
    b = balanced_assignment(cost.astype(np.float64).copy())
    c = balanced_assignment(np.asfortranarray(cost.astype(np.float32)))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)


def test_greedy_would_be_wrong():
    # every point prefers cluster 0; the optimum sends the points that lose least elsewhere
    cost = np.array([[0.0, 10.0], [0.0, 1.0], [0.0, 5.0], [0.0, 2.0]])
    np.testing.assert_array_equal(balanced_assignment(cost), [0, 1, 0, 1])


def test_errors():
    with pytest.raises(ValueError, match="equal clusters"):
        balanced_assignment(np.zeros((7, 3)))
    with pytest.raises(ValueError, match="do not fit"):
        balanced_assignment(np.zeros((7, 3)), capacity=2)
    with pytest.raises(ValueError, match="finite"):
        balanced_assignment(np.array([[0.0, np.nan], [1.0, 2.0]]))
    with pytest.raises(ValueError, match=r"\[n, k\]"):
        balanced_assignment(np.zeros(4))

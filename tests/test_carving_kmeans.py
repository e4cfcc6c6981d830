"""Balanced K-means on binary marker columns, checked with dense numpy/scipy references."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from scipy.spatial.distance import cdist

from cmoe_jax.carving import (assignment_cost, balanced_kmeans, markers_to_points,
                              repeated_column_reference, squared_distances)


def _points(seed, n=48, tokens=200, density=0.3):
    rng = np.random.default_rng(seed)
    return (rng.random((n, tokens)) < rng.random((n, 1)) * density).astype(np.uint8)


def _clustered(seed, n=96, tokens=300, groups=6):
    # noisy copies of a few prototypes: K-means needs several steps to settle
    rng = np.random.default_rng(seed)
    proto = rng.random((groups, tokens)) < 0.15
    return (proto[rng.integers(0, groups, n)] ^ (rng.random((n, tokens)) < 0.12)).astype(np.uint8)


def _means(points, labels, k):
    return np.stack([points[labels == j].mean(axis=0) for j in range(k)])


@pytest.mark.parametrize("seed", range(10))
def test_balanced_monotone_converged(seed):
    if seed < 6:
        points, k = _points(seed), [2, 3, 4, 6, 8, 12][seed]
    else:
        points, k = _clustered(seed - 6), 8
    init = np.arange(k) * 3
    km = balanced_kmeans(points, init)
    assert np.bincount(km.labels, minlength=k).tolist() == [len(points) // k] * k
    if seed >= 6:
        assert km.iterations >= 3 and km.costs[-1] < km.costs[1]  # several real steps
    assert all(b <= a + 1e-9 * abs(a) for a, b in zip(km.costs, km.costs[1:]))
    assert km.iterations == len(km.costs)
    # centroids are the member means; at convergence the exact assignment to them (reference
    # LSA on dense squared distances) cannot do better than the final partition
    cen = _means(points.astype(float), km.labels, k)
    np.testing.assert_allclose(km.centroids, cen, rtol=0, atol=1e-15)
    d = cdist(points.astype(float), cen, "sqeuclidean")
    ref = repeated_column_reference(d)
    assert assignment_cost(d, km.labels) == pytest.approx(assignment_cost(d, ref), abs=1e-9)
    # reported objective of the last step = dense sum of squared distances
    assert km.costs[-1] == pytest.approx(assignment_cost(d, km.labels), rel=1e-12)


def test_first_step_is_optimal_hamming_assignment():
    points = _points(11, n=60, tokens=150)
    init = np.array([5, 17, 2, 40])
    km = balanced_kmeans(points, init, max_iters=1)
    assert km.iterations == 1
    # labels come from step 1: distances to the initial points (Hamming = squared L2 = L1)
    first = km.labels
    ham = cdist(points.astype(bool), points[init].astype(bool), "hamming") * points.shape[1]
    assert assignment_cost(ham, first) == pytest.approx(assignment_cost(ham, repeated_column_reference(ham)))
    assert km.costs[0] == pytest.approx(assignment_cost(ham, first))
    # after one step the centroids are the member means (the authors' code updates them too)
    np.testing.assert_allclose(km.centroids, _means(points.astype(float), first, 4), atol=1e-15)


def test_l1_step_equivalence_with_real_centroids():
    # the authors' torch.cdist(p=1) against real-valued centroids gives the same optimal
    # balanced assignments as squared L2 (they differ by a per-cluster constant)
    points = _points(3, n=40, tokens=120)
    init = np.array([0, 9, 33, 21, 12])
    one = balanced_kmeans(points, init, max_iters=1)
    two = balanced_kmeans(points, init, max_iters=2)
    l1 = cdist(points.astype(float), one.centroids, "cityblock")
    assert assignment_cost(l1, two.labels) == pytest.approx(assignment_cost(l1, repeated_column_reference(l1)),
                                                           abs=1e-9)


def test_squared_distances_dense_reference():
    points = _points(5, n=30, tokens=90)
    labels = np.repeat(np.arange(3), 10)
    counts = np.stack([points[labels == j].sum(axis=0) for j in range(3)], axis=1).astype(np.int64)
    d = squared_distances(points, counts, 10)
    np.testing.assert_allclose(d, cdist(points.astype(float), counts.T / 10.0, "sqeuclidean"), atol=1e-12)


def test_deterministic_and_input_forms_agree():
    points = _points(9, n=120, tokens=400, density=0.1)
    init = np.array([1, 50, 7, 99, 64, 3])
    a = balanced_kmeans(points, init)
    b = balanced_kmeans(points.copy(), init.copy())
    c = balanced_kmeans(sp.csr_matrix(points.astype(bool)), init)
    d = balanced_kmeans(points.astype(np.float32), init)
    for other in (b, c, d):
        np.testing.assert_array_equal(a.labels, other.labels)
        np.testing.assert_array_equal(a.centroid_counts, other.centroid_counts)
        assert a.costs == other.costs and a.iterations == other.iterations


def test_markers_to_points():
    rng = np.random.default_rng(2)
    markers = rng.random((50, 20)) < 0.3
    cols = np.array([3, 0, 19, 7])
    pts = markers_to_points(markers, cols)
    np.testing.assert_array_equal(pts.toarray(), markers[:, cols].T.astype(np.int64))
    np.testing.assert_array_equal(markers_to_points(markers.astype(np.uint8), cols).toarray(), pts.toarray())
    bad = markers.astype(np.uint8)
    bad[0, 0] = 2
    with pytest.raises(ValueError, match="binary"):
        markers_to_points(bad, cols)


def test_max_iters_bounds_and_errors():
    points = _points(4)
    full = balanced_kmeans(points, np.arange(4))
    capped = balanced_kmeans(points, np.arange(4), max_iters=2)
    assert capped.iterations == min(2, full.iterations)
    with pytest.raises(ValueError, match="binary"):
        balanced_kmeans(points * 2, np.arange(4))
    with pytest.raises(ValueError, match="equal clusters"):
        balanced_kmeans(points, np.arange(5))
    with pytest.raises(ValueError, match="distinct"):
        balanced_kmeans(points, np.array([0, 0, 1, 2]))
    with pytest.raises(ValueError, match="max_iters"):
        balanced_kmeans(points, np.arange(4), max_iters=0)

"""Exact balanced assignment: n points to k clusters of capacity m, minimum total cost.

The papers (and the authors' code) solve it as an n x n linear assignment on a matrix whose
k columns are each repeated m times. It is really a transportation problem with k sinks, so
we solve it by successive shortest paths (SSP) on the k cluster nodes: points are inserted
one at a time (most decided first); a point whose cheapest cluster (in reduced cost) has room goes there
directly, otherwise Dijkstra over the k clusters finds the cheapest chain of moves ending in
a cluster with room. The residual graph collapses exactly onto the clusters: a move j -> l
goes through a member i of j at cost c[i, l] - c[i, j], and only the cheapest member per
(j, l) matters, so the members of each cluster j are kept in k - 1 indexed binary heaps,
one per target l, keyed by that move cost (ties: lower point index). Cluster potentials
keep every reduced cost non-negative, so each step is exact and the result is an optimal
integral vertex of the transportation LP (the same optimal cost as the n x n assignment),
in O(n k^2) plus O(k log m) per moved point and O(n k) memory, instead of O(n^3) time and
O(n^2) memory.
"""
from __future__ import annotations

import numpy as np


def balanced_assignment(cost, capacity: int | None = None) -> np.ndarray:
    """Cluster id per point (int64 [n]) minimising sum cost[i, label[i]], at most `capacity`
    points per cluster.

    cost: [n, k] real (integer costs are solved in exact arithmetic). capacity defaults to
    n // k, and n must then be k * capacity: a partition into equal clusters. Deterministic:
    points are inserted by decreasing cost spread max_j - min_j (ties: index order), and
    ties in the search go to the lower cluster / point index.
    Compiled with numba (the augmentations are inherently sequential), on first use.
    """
    cost = np.ascontiguousarray(cost, dtype=np.float64)
    if cost.ndim != 2 or cost.shape[1] < 1:
        raise ValueError(f"cost must be [n, k] with k >= 1, got shape {cost.shape}")
    n, k = cost.shape
    if capacity is None:
        if n % k:
            raise ValueError(f"{n} points cannot form {k} equal clusters; pass capacity")
        cap = n // k
    else:
        cap = int(capacity)
    if cap * k < n:
        raise ValueError(f"{n} points do not fit in {k} clusters of capacity {cap}")
    if not np.isfinite(cost).all():
        raise ValueError("assignment costs must be finite")
    if n == 0:
        return np.zeros(0, np.int64)
    # Insert points with strong preferences first: any order is exact, but this one avoids
    # long chains of moves (with rank-1 costs c = a_i b_j, as co-activation counts nearly
    # are, it needs no move at all, where index order can move every point k times).
    order = np.argsort(cost.min(axis=1) - cost.max(axis=1), kind="stable")
    label = np.empty(n, np.int64)
    from cmoe_jax.carving.ssp import ssp  # numba loads here, not when the package is imported

    label[order] = ssp(np.ascontiguousarray(cost[order]), max(cap, 1))
    return label


def assignment_cost(cost, label) -> float:
    """sum_i cost[i, label[i]] in float64."""
    label = np.asarray(label)
    return float(np.asarray(cost, np.float64)[np.arange(len(label)), label].sum())


def repeated_column_reference(cost, capacity: int | None = None) -> np.ndarray:
    """The papers' reduction, for tests and benchmarks: LSA on the [n, k * capacity] matrix
    whose k columns are each repeated `capacity` times (n x n when n = k * capacity)."""
    from scipy.optimize import linear_sum_assignment

    n, k = np.shape(cost)
    cap = n // k if capacity is None else int(capacity)
    extended = np.repeat(np.asarray(cost, np.float64), cap, axis=1)
    rows, cols = linear_sum_assignment(extended)
    label = np.empty(n, dtype=np.int64)
    label[rows] = cols // cap
    return label

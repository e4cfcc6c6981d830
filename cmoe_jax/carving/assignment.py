"""Exact balanced assignment: n points to k clusters of capacity m, minimum total cost.

The papers (and the authors' code) solve it as an n x n linear assignment on a matrix whose
k columns are each repeated m times. It is really a transportation problem with k sinks, so
we solve it by successive shortest paths (SSP) on the k cluster nodes: points are inserted
one at a time; a point whose cheapest cluster (in reduced cost) has room goes there
directly, otherwise Dijkstra over the k clusters finds the cheapest chain of moves ending in
a cluster with room. The residual graph collapses exactly onto the clusters: a move j -> l
goes through a member i of j at cost c[i, l] - c[i, j], and only the cheapest member per
(j, l) matters, so a k x k table of cheapest moves is kept (rescanned over a cluster's
members only when the point it names leaves). Cluster potentials keep every reduced cost
non-negative, so each step is exact and the result is an optimal integral vertex of the
transportation LP (the same optimal cost as the n x n assignment), in O(n k^2) plus O(m k)
per moved point, instead of O(n^3).
"""
from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True)
def _join(i, l, cost, label, count, members, pos, best, arg):  # pragma: no cover - compiled
    members[l, count[l]] = i
    pos[i] = count[l]
    count[l] += 1
    label[i] = l
    k = cost.shape[1]
    for q in range(k):
        if q != l:
            v = cost[i, q] - cost[i, l]
            if v < best[l, q] or (v == best[l, q] and i < arg[l, q]):
                best[l, q] = v
                arg[l, q] = i


@numba.njit(cache=True)
def _leave(i, j, cost, count, members, pos, best, arg):  # pragma: no cover - compiled
    last = members[j, count[j] - 1]
    members[j, pos[i]] = last
    pos[last] = pos[i]
    count[j] -= 1
    k = cost.shape[1]
    stale = False
    for q in range(k):
        if arg[j, q] == i:
            stale = True
    if stale:  # i was one of j's cheapest moves: rescan j's members
        for q in range(k):
            best[j, q] = np.inf
            arg[j, q] = -1
        for t in range(count[j]):
            p = members[j, t]
            for q in range(k):
                if q != j:
                    v = cost[p, q] - cost[p, j]
                    if v < best[j, q] or (v == best[j, q] and p < arg[j, q]):
                        best[j, q] = v
                        arg[j, q] = p


@numba.njit(cache=True)
def _ssp(cost, cap):  # pragma: no cover - compiled
    n, k = cost.shape
    pi = np.zeros(k)
    label = np.full(n, -1, np.int64)
    count = np.zeros(k, np.int64)
    members = np.empty((k, cap), np.int64)
    pos = np.empty(n, np.int64)
    # best[j, l] / arg[j, l]: cheapest move of a member of j to l, c_il - c_ij, and its point
    best = np.full((k, k), np.inf)
    arg = np.full((k, k), -1, np.int64)
    dist = np.empty(k)
    prev = np.empty(k, np.int64)
    via = np.empty(k, np.int64)
    done = np.empty(k, np.bool_)
    for s in range(n):
        j0 = 0
        for j in range(1, k):
            if cost[s, j] - pi[j] < cost[s, j0] - pi[j0]:
                j0 = j
        sink = j0
        prev[j0] = -1
        if count[j0] >= cap:
            base = cost[s, j0] - pi[j0]
            for j in range(k):
                dist[j] = cost[s, j] - pi[j] - base
                prev[j] = -1
                via[j] = -1
                done[j] = False
            while True:  # Dijkstra over clusters; ties: lowest cluster index
                j = -1
                for c in range(k):
                    if not done[c] and (j < 0 or dist[c] < dist[j]):
                        j = c
                done[j] = True
                if count[j] < cap:
                    sink = j
                    break
                for l in range(k):
                    if not done[l] and arg[j, l] >= 0:
                        nd = dist[j] + pi[j] + best[j, l] - pi[l]
                        if nd < dist[l]:
                            dist[l] = nd
                            prev[l] = j
                            via[l] = arg[j, l]
            limit = dist[sink]
            for j in range(k):
                pi[j] += min(dist[j], limit)
        # walk the path back from the sink, shifting one point along each edge
        l = sink
        while prev[l] != -1:
            j = prev[l]
            i = via[l]
            _leave(i, j, cost, count, members, pos, best, arg)
            _join(i, l, cost, label, count, members, pos, best, arg)
            l = j
        _join(s, l, cost, label, count, members, pos, best, arg)
    return label


def balanced_assignment(cost, capacity: int | None = None) -> np.ndarray:
    """Cluster id per point (int64 [n]) minimising sum cost[i, label[i]], at most `capacity`
    points per cluster.

    cost: [n, k] real (integer costs are solved in exact arithmetic). capacity defaults to
    n // k, and n must then be k * capacity: a partition into equal clusters. Deterministic:
    points are inserted in index order and ties go to the lower cluster / point index.
    Compiled with numba (the augmentations are inherently sequential).
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
    return _ssp(cost, max(cap, 1))


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

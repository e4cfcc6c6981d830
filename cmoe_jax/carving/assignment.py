"""Exact balanced assignment: n points to k clusters of capacity m, minimum total cost.

The papers (and the authors' code) solve it as an n x n linear assignment on a matrix whose
k columns are each repeated m times. It is really a transportation problem with k sinks, so
we solve it by successive shortest paths on the k cluster nodes: points are inserted one at a
time; a point whose cheapest cluster (in reduced cost) has room goes there directly, otherwise
Dijkstra over the k clusters finds the cheapest chain of moves ending in a cluster with room.
The cheapest move j -> l of every cluster pair is kept in a k x k table (rescanned only when
its point leaves), and cluster potentials keep all reduced costs non-negative, so every step
is exact: the result is an optimal vertex of the transportation LP (the same optimal cost as
the n x n assignment) in O(n k^2) work plus O(n k) per moved point, instead of O(n^3).
"""
from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True)
def _ssp(cost, cap):  # pragma: no cover - compiled
    n, k = cost.shape
    pi = np.zeros(k)
    label = np.full(n, -1, np.int64)
    count = np.zeros(k, np.int64)
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
        if count[j0] < cap:
            sink = j0
            prev[j0] = -1
        else:
            base = cost[s, j0] - pi[j0]
            for j in range(k):
                dist[j] = cost[s, j] - pi[j] - base
                prev[j] = -1
                via[j] = -1
                done[j] = False
            while True:
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
            count[j] -= 1
            label[i] = l
            count[l] += 1
            for q in range(k):  # i joins l
                if q != l and cost[i, q] - cost[i, l] < best[l, q]:
                    best[l, q] = cost[i, q] - cost[i, l]
                    arg[l, q] = i
            stale = False       # i left j: rescan j if it was one of j's cheapest moves
            for q in range(k):
                if arg[j, q] == i:
                    stale = True
            if stale:
                for q in range(k):
                    best[j, q] = np.inf
                    arg[j, q] = -1
                for p in range(n):
                    if label[p] == j:
                        for q in range(k):
                            if q != j and cost[p, q] - cost[p, j] < best[j, q]:
                                best[j, q] = cost[p, q] - cost[p, j]
                                arg[j, q] = p
            l = j
        label[s] = l
        count[l] += 1
        for q in range(k):
            if q != l and cost[s, q] - cost[s, l] < best[l, q]:
                best[l, q] = cost[s, q] - cost[s, l]
                arg[l, q] = s
    return label


def balanced_assignment(cost: np.ndarray, capacity: int | None = None) -> np.ndarray:
    """Cluster id per point minimising sum cost[i, label[i]] with at most `capacity` per cluster.

    cost: [n, k]; capacity defaults to n // k (n must then be k * capacity, a partition into
    equal clusters). Deterministic: ties go to the lower cluster index, points are inserted
    in index order. Compiled with numba (the loop is inherently sequential).
    """
    cost = np.ascontiguousarray(cost, dtype=np.float64)
    n, k = cost.shape
    cap = n // k if capacity is None else int(capacity)
    if cap * k < n:
        raise ValueError(f"{n} points do not fit in {k} clusters of capacity {cap}")
    if not np.isfinite(cost).all():
        raise ValueError("assignment costs must be finite")
    return _ssp(cost, cap)


def assignment_cost(cost: np.ndarray, label: np.ndarray) -> float:
    return float(np.asarray(cost, np.float64)[np.arange(len(label)), label].sum())


def repeated_column_reference(cost: np.ndarray, capacity: int | None = None) -> np.ndarray:
    """The papers' reduction, for tests and benchmarks: n x n LSA on repeated columns."""
    from scipy.optimize import linear_sum_assignment

    n, k = cost.shape
    cap = n // k if capacity is None else capacity
    extended = np.repeat(np.asarray(cost, np.float64), cap, axis=1)
    rows, cols = linear_sum_assignment(extended)
    label = np.empty(n, dtype=np.int64)
    label[rows] = cols // cap
    return label

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

import numba
import numpy as np
from scipy.optimize import linear_sum_assignment


@numba.njit(cache=True, inline="always")
def _before(cost, a, b, j, q):  # pragma: no cover - compiled
    """Is moving a (member of j) to q cheaper than moving b? Ties: lower point index."""
    ka = cost[a, q] - cost[a, j]
    kb = cost[b, q] - cost[b, j]
    return ka < kb or (ka == kb and a < b)


@numba.njit(cache=True, inline="always")
def _swap(h, hpos, q, s, t):  # pragma: no cover - compiled
    """Swap heap slots s and t of heap `h`, recording the points' new slots in `hpos`."""
    h[s], h[t] = h[t], h[s]
    hpos[h[s], q] = s
    hpos[h[t], q] = t


@numba.njit(cache=True)
def _sift(heap, hpos, cost, j, q, t, size):  # pragma: no cover - compiled
    h = heap[j, q]
    while t > 0:  # up
        par = (t - 1) // 2
        if not _before(cost, h[t], h[par], j, q):
            break
        _swap(h, hpos, q, t, par)
        t = par
    while True:  # down
        c = 2 * t + 1
        if c >= size:
            break
        if c + 1 < size and _before(cost, h[c + 1], h[c], j, q):
            c += 1
        if not _before(cost, h[c], h[t], j, q):
            break
        _swap(h, hpos, q, t, c)
        t = c


@numba.njit(cache=True)
def _join(i, l, cost, label, count, heap, hpos):  # pragma: no cover - compiled
    size = count[l]
    for q in range(cost.shape[1]):
        if q != l:
            heap[l, q, size] = i
            hpos[i, q] = size
            _sift(heap, hpos, cost, l, q, size, size + 1)
    count[l] = size + 1
    label[i] = l


@numba.njit(cache=True)
def _leave(i, j, cost, count, heap, hpos):  # pragma: no cover - compiled
    size = count[j] - 1
    for q in range(cost.shape[1]):
        if q != j:
            t = hpos[i, q]
            if t < size:
                last = heap[j, q, size]
                heap[j, q, t] = last
                hpos[last, q] = t
                _sift(heap, hpos, cost, j, q, t, size)
    count[j] = size


@numba.njit(cache=True)
def _ssp(cost, cap):  # pragma: no cover - compiled
    n, k = cost.shape
    pi = np.zeros(k)
    label = np.full(n, -1, np.int64)
    count = np.zeros(k, np.int64)
    # heap[j, q, :count[j]]: members p of j, a binary heap on the move cost c[p, q] - c[p, j]
    # (its top is the cheapest move j -> q); hpos[p, q]: p's slot in heap[label[p], q]
    heap = np.empty((k, k, cap), np.int64)
    hpos = np.empty((n, k), np.int64)
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
                    if not done[l]:
                        p = heap[j, l, 0]
                        nd = dist[j] + pi[j] + (cost[p, l] - cost[p, j]) - pi[l]
                        if nd < dist[l]:
                            dist[l] = nd
                            prev[l] = j
                            via[l] = p
            limit = dist[sink]
            for j in range(k):
                pi[j] += min(dist[j], limit)
        # walk the path back from the sink, shifting one point along each edge
        l = sink
        while prev[l] != -1:
            j = prev[l]
            i = via[l]
            _leave(i, j, cost, count, heap, hpos)
            _join(i, l, cost, label, count, heap, hpos)
            l = j
        _join(s, l, cost, label, count, heap, hpos)
    return label


def balanced_assignment(cost, capacity: int | None = None) -> np.ndarray:
    """Cluster id per point (int64 [n]) minimising sum cost[i, label[i]], at most `capacity`
    points per cluster.

    cost: [n, k] real (integer costs are solved in exact arithmetic). capacity defaults to
    n // k, and n must then be k * capacity: a partition into equal clusters. Deterministic:
    points are inserted by decreasing cost spread max_j - min_j (ties: index order), and
    ties in the search go to the lower cluster / point index.
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
    # Insert points with strong preferences first: any order is exact, but this one avoids
    # long chains of moves (with rank-1 costs c = a_i b_j, as co-activation counts nearly
    # are, it needs no move at all, where index order can move every point k times).
    order = np.argsort(cost.min(axis=1) - cost.max(axis=1), kind="stable")
    label = np.empty(n, np.int64)
    label[order] = _ssp(np.ascontiguousarray(cost[order]), max(cap, 1))
    return label


def assignment_cost(cost, label) -> float:
    """sum_i cost[i, label[i]] in float64."""
    label = np.asarray(label)
    return float(np.asarray(cost, np.float64)[np.arange(len(label)), label].sum())


def repeated_column_reference(cost, capacity: int | None = None) -> np.ndarray:
    """The papers' reduction, for tests and benchmarks: LSA on the [n, k * capacity] matrix
    whose k columns are each repeated `capacity` times (n x n when n = k * capacity)."""

    n, k = np.shape(cost)
    cap = n // k if capacity is None else int(capacity)
    extended = np.repeat(np.asarray(cost, np.float64), cap, axis=1)
    rows, cols = linear_sum_assignment(extended)
    label = np.empty(n, dtype=np.int64)
    label[rows] = cols // cap
    return label

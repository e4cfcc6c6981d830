"""Exact balanced assignment: n points to k clusters of capacity m, minimum total cost.

The papers (and the authors' code) solve it as an n x n linear assignment on a matrix whose
k columns are each repeated m times. It is really a transportation problem with k sinks, so
we solve it by successive shortest paths on the k cluster nodes: points are inserted one at a
time; a point whose cheapest cluster (in reduced cost) has room goes there directly, otherwise
Dijkstra over the k clusters finds the cheapest chain of moves ending in a cluster with room.
The cheapest move j -> l is kept in a lazy heap per cluster pair, and cluster potentials keep
all reduced costs non-negative, so every step is exact: the result is an optimal vertex of
the transportation LP (the same optimal cost as the n x n assignment), in O(n k^2) heap work
instead of O(n^3).
"""
from __future__ import annotations

import heapq

import numpy as np


def balanced_assignment(cost: np.ndarray, capacity: int | None = None) -> np.ndarray:
    """Cluster id per point minimising sum cost[i, label[i]] with at most `capacity` per cluster.

    cost: [n, k]; capacity defaults to n // k (n must then be k * capacity, a partition into
    equal clusters). Deterministic: ties go to the lower cluster index, points are inserted
    in index order.
    """
    cost = np.asarray(cost, dtype=np.float64)
    n, k = cost.shape
    cap = n // k if capacity is None else int(capacity)
    if cap * k < n:
        raise ValueError(f"{n} points do not fit in {k} clusters of capacity {cap}")
    if not np.isfinite(cost).all():
        raise ValueError("assignment costs must be finite")
    pi = np.zeros(k)                      # cluster potentials
    label = np.full(n, -1, dtype=np.int64)
    count = np.zeros(k, dtype=np.int64)
    heaps = [[[] for _ in range(k)] for _ in range(k)]   # heaps[j][l]: (c_il - c_ij, i), i in j
    rows = cost.tolist()

    def place(i: int, j: int) -> None:
        label[i] = j
        count[j] += 1
        ci = rows[i]
        base = ci[j]
        hj = heaps[j]
        for l in range(k):
            if l != j:
                heapq.heappush(hj[l], (ci[l] - base, i))

    def cheapest_move(j: int, l: int):
        h = heaps[j][l]
        while h and label[h[0][1]] != j:
            heapq.heappop(h)
        return h[0] if h else None

    for s in range(n):
        reduced = cost[s] - pi
        j0 = int(np.argmin(reduced))
        if count[j0] < cap:
            place(s, j0)
            continue
        dist = (reduced - reduced[j0]).tolist()
        prev = [-1] * k
        via = [-1] * k
        done = [False] * k
        pil = pi.tolist()
        while True:
            j = min((d, c) for c, d in enumerate(dist) if not done[c])[1]
            done[j] = True
            if count[j] < cap:
                sink = j
                break
            dj = dist[j] + pil[j]
            for l in range(k):
                if done[l]:
                    continue
                move = cheapest_move(j, l)
                if move is not None:
                    nd = dj + move[0] - pil[l]
                    if nd < dist[l]:
                        dist[l], prev[l], via[l] = nd, j, move[1]
        limit = dist[sink]
        pi += np.minimum(np.asarray(dist), limit)
        l = sink
        while prev[l] != -1:  # shift one point along each edge of the path
            j, i = prev[l], via[l]
            count[j] -= 1
            place(i, l)
            l = j
        place(s, l)
    return label


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

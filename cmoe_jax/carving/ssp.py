"""The compiled kernels of `balanced_assignment` (successive shortest paths over the k
clusters, with per-cluster indexed heaps; see `cmoe_jax.carving.assignment`). A module of
their own, imported when an assignment first runs, so that importing the carving package
(and `carve_ffn`) does not load numba.
"""
from __future__ import annotations

import numba
import numpy as np


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
def ssp(cost, cap):  # pragma: no cover - compiled
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

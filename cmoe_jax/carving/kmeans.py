"""Balanced K-means of neurons on their binary activation-marker columns.

Each neuron is a point p_i in {0,1}^T: its column of ATopK markers over the T calibration
tokens. Distances are squared L2, which on binary points is the Hamming distance and, to a
real centroid c_j = C_j / s (C_j the member count per token, s the cluster size),

    ||p_i - c_j||^2 = |p_i| - 2 p_i.C_j / s + ||C_j||^2 / s^2.

In a balanced assignment every cluster takes the same number of points, so the per-cluster
term ||C_j||^2 / s^2 and the per-point term |p_i| add the same amount to every feasible
assignment: the assignment depends only on the integer co-activation counts G = P C, and is
solved exactly on -G. The same holds for the authors' L1 distance (torch.cdist p=1):
|p_i - c_j|_1 = |p_i| + sum(c_j) - 2 p_i.c_j differs from the squared L2 only by a per-cluster
constant, so both give the same partitions. (The papers' eq. 6 writes the square root; with
it the mean update would not be the minimiser and the objective could go up.) Squared L2 with
mean updates is Lloyd's K-means: the objective never increases.

Markers are binary and very sparse (K_a of d_h per token), so points are kept as a sparse
[n, T] matrix and every product is a sparse matmul: nothing of size T x n x k, nor a dense
float copy of the markers, is formed.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import scipy.sparse as sp

from cmoe_jax.carving.assignment import balanced_assignment


@dataclasses.dataclass
class KMeansResult:
    labels: np.ndarray          # int64 [n] cluster per point
    centroid_counts: np.ndarray  # int64 [T, k]: members of cluster j active at token t
    cluster_size: int           # s: points per cluster (centroid = centroid_counts / s)
    iterations: int             # assignment steps run
    costs: list                 # sum of squared distances to the centroids used, per step
    assign_seconds: float       # time spent in the exact balanced assignment

    @property
    def centroids(self) -> np.ndarray:
        """[k, T] float64 cluster means."""
        return self.centroid_counts.T / float(self.cluster_size)


def binary_points(points) -> sp.csr_matrix:
    """Binary points [n, T] (dense bool/int/float 0-1, or scipy sparse) as int64 CSR."""
    if sp.issparse(points):
        csr = sp.csr_matrix(points, dtype=np.int64)
        csr.sum_duplicates()
        data = csr.data
    else:
        dense = np.asarray(points)
        if dense.ndim != 2:
            raise ValueError(f"points must be [n, T], got shape {dense.shape}")
        rows, cols = np.nonzero(dense)
        data = dense[rows, cols]
        csr = sp.csr_matrix((np.ones(len(rows), np.int64), (rows, cols)), shape=dense.shape)
    if not np.all(data == 1):
        raise ValueError("marker points must be binary (0/1)")
    csr.eliminate_zeros()
    return csr


def markers_to_points(markers, columns) -> sp.csr_matrix:
    """Neuron points [len(columns), T] from a binary marker matrix [T, d_h] (bool/uint8/...)."""
    markers = np.asarray(markers)
    if markers.ndim != 2:
        raise ValueError(f"markers must be [T, d_h], got shape {markers.shape}")
    columns = np.asarray(columns, np.int64)
    flat = np.flatnonzero(markers)  # much faster than a 2-D np.nonzero on [T, d_h]
    if markers.dtype != np.bool_ and not np.all(markers.reshape(-1)[flat] == 1):
        raise ValueError("markers must be binary (0/1)")
    t_idx, neuron = np.divmod(flat, markers.shape[1])
    row_of = np.full(markers.shape[1], -1, np.int64)
    row_of[columns] = np.arange(len(columns))
    keep = row_of[neuron] >= 0
    return sp.csr_matrix((np.ones(int(keep.sum()), np.int64), (row_of[neuron[keep]], t_idx[keep])),
                         shape=(len(columns), markers.shape[0]))


def cooccurrence(points: sp.csr_matrix, centroid_counts: np.ndarray) -> np.ndarray:
    """G = P C: int64 [n, k], tokens where point i and the members of cluster j are active."""
    return np.asarray(points @ centroid_counts, dtype=np.int64)


def squared_distances(points, centroid_counts: np.ndarray, cluster_size: int) -> np.ndarray:
    """||p_i - C_j / s||^2, float64 [n, k], for binary points [n, T] and counts C [T, k]."""
    points = points if sp.issparse(points) else binary_points(points)
    s = float(cluster_size)
    norms = np.asarray(points.sum(axis=1), np.float64).ravel()
    c_sq = (centroid_counts.astype(np.float64) ** 2).sum(axis=0) / (s * s)
    return norms[:, None] - 2.0 * cooccurrence(points, centroid_counts) / s + c_sq[None, :]


def _counts(points: sp.csr_matrix, labels: np.ndarray, k: int) -> np.ndarray:
    onehot = sp.csr_matrix((np.ones(len(labels), np.int64), (np.arange(len(labels)), labels)),
                           shape=(len(labels), k))
    return np.asarray((points.T @ onehot).toarray(), dtype=np.int64)


def _objective(points_norm_sum: float, g_sel: int, counts: np.ndarray, sizes: np.ndarray, s: int) -> float:
    # sum_i ||p_i - C_l(i)/s||^2 = sum|p| - 2 sum G_i,l(i) / s + sum_j n_j ||C_j||^2 / s^2
    c_sq = (counts.astype(np.float64) ** 2).sum(axis=0)
    return float(points_norm_sum - 2.0 * g_sel / s + (sizes * c_sq).sum() / (s * s))


def balanced_kmeans(points, init, max_iters: int | None = None) -> KMeansResult:
    """Cluster binary points [n, T] into k = len(init) clusters of exactly n / k points.

    points: dense binary [n, T] or scipy sparse (see `markers_to_points`); init: the k point
    ids whose columns are the initial centroids. Each step assigns all points exactly
    (minimum total squared distance under the balance constraint), then moves every centroid
    to the mean of its members. Stops when the assignment (hence the centroids) no longer
    changes, or after `max_iters` assignment steps (1 reproduces the authors' code: one
    assignment to the initial centroids, then the centroid update). Integer arithmetic
    throughout the assignment: the same inputs give the same partition, bit for bit.
    """
    points = points if sp.issparse(points) and points.dtype == np.int64 else binary_points(points)
    points = sp.csr_matrix(points)
    n = points.shape[0]
    init = np.asarray(init, np.int64)
    k = len(init)
    if k < 1 or n % k:
        raise ValueError(f"{n} points cannot form {k} equal clusters")
    if len(np.unique(init)) != k or init.min() < 0 or init.max() >= n:
        raise ValueError(f"init must be {k} distinct point ids in [0, {n})")
    if max_iters is not None and max_iters < 1:
        raise ValueError(f"max_iters must be >= 1 or None, got {max_iters}")
    m = n // k
    norm_sum = float(points.sum())
    counts = np.asarray(points[init].T.toarray(), dtype=np.int64)  # [T, k], clusters of size 1
    size = 1
    labels, costs, it, t_assign = None, [], 0, 0.0
    while max_iters is None or it < max_iters:
        g = cooccurrence(points, counts)
        t0 = time.perf_counter()
        new = balanced_assignment(-g.astype(np.float64))  # exact: |G| < 2**53
        t_assign += time.perf_counter() - t0
        costs.append(_objective(norm_sum, int(g[np.arange(n), new].sum()), counts,
                                np.bincount(new, minlength=k), size))
        it += 1
        if labels is not None and np.array_equal(new, labels):
            break
        labels = new
        new_counts = _counts(points, labels, k)
        if size == m and np.array_equal(new_counts, counts):
            break  # centroids unchanged: the next assignment would repeat this one
        counts, size = new_counts, m
    return KMeansResult(labels, counts, size, it, costs, t_assign)

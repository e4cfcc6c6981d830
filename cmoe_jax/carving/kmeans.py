"""Balanced K-means of neurons on their binary activation-marker columns.

Each neuron is a point: its column of markers over the calibration tokens. Distances are
L2 (eq. 6 of the paper), computed from Gram products without forming [n, k, T] differences;
each assignment step is the exact balanced assignment of `assignment.py`.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from cmoe_jax.carving.assignment import assignment_cost, balanced_assignment


@dataclasses.dataclass
class KMeansResult:
    labels: np.ndarray        # [n] cluster per point
    centroids: np.ndarray     # [k, T]
    iterations: int
    costs: list               # assignment cost (sum of distances) per iteration


def l2_distances(points: np.ndarray, point_sq: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """||p - c|| for binary points [n, T] (as float32) and real centroids [k, T]."""
    sq = point_sq[:, None] + (centroids * centroids).sum(axis=1)[None, :] - 2.0 * (points @ centroids.T)
    return np.sqrt(np.maximum(sq.astype(np.float64), 0.0))


def balanced_kmeans(points: np.ndarray, init: np.ndarray, max_iters: int | None = None) -> KMeansResult:
    """Cluster binary points [n, T] into k = len(init) clusters of n/k, from init point ids.

    Stops when the assignment no longer changes, or after `max_iters` assignment steps
    (1 reproduces the authors' code: a single assignment to the initial centroids).
    """
    points = np.asarray(points, dtype=np.float32)
    n = points.shape[0]
    k = len(init)
    if n % k:
        raise ValueError(f"{n} neurons cannot form {k} equal clusters")
    point_sq = points.sum(axis=1) if np.all((points == 0) | (points == 1)) else (points * points).sum(axis=1)
    centroids = points[np.asarray(init)].copy()
    labels, costs, it = None, [], 0
    while max_iters is None or it < max_iters:
        dist = l2_distances(points, point_sq, centroids)
        new = balanced_assignment(dist)
        costs.append(assignment_cost(dist, new))
        it += 1
        if labels is not None and np.array_equal(new, labels):
            break
        labels = new
        for j in range(k):
            centroids[j] = points[labels == j].mean(axis=0)
    return KMeansResult(labels, centroids, it, costs)

"""Analytical router: each routed expert is represented by its neuron closest to the cluster
centroid; the router scores a token with those neurons' (normalised) gate and up columns."""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from cmoe_jax.carving.kmeans import cooccurrence


def representative_neurons(points: sp.csr_matrix, labels, centroid_counts, cluster_size: int) -> np.ndarray:
    """Per cluster j, the member point closest (squared L2) to its centroid C_j / s.

    ||p_i - C_j/s||^2 = (s |p_i| - 2 p_i.C_j) / s + const_j, so the argmin is taken on the
    integer s|p_i| - 2 G_ij: exact, ties to the lowest point index. Returns point ids [k].
    """
    labels = np.asarray(labels)
    k = centroid_counts.shape[1]
    norms = np.asarray(points.sum(axis=1), np.int64).ravel()
    score = cluster_size * norms[:, None] - 2 * cooccurrence(points, centroid_counts)
    reps = np.empty(k, np.int64)
    for j in range(k):
        members = np.flatnonzero(labels == j)
        if not len(members):
            raise ValueError(f"cluster {j} has no members")
        reps[j] = members[np.argmin(score[members, j])]  # argmin: first (lowest id) on ties
    return reps


def _unit_columns(w):
    if isinstance(w, np.ndarray):
        w32 = w.astype(np.float32)
        return (w32 / np.maximum(np.linalg.norm(w32, axis=0, keepdims=True), 1e-12)).astype(w.dtype)
    import jax.numpy as jnp

    w32 = w.astype(jnp.float32)
    return (w32 / jnp.maximum(jnp.linalg.norm(w32, axis=0, keepdims=True), 1e-12)).astype(w.dtype)


def router_weights(w_gate, w_up, representative_idx, normalize: bool = True) -> tuple:
    """(router_gate [d, N_r], router_up [d, N_r]): the representative neurons' weight columns
    of W_gate, W_up [d, d_h], each scaled to unit L2 norm (as for the profiling) unless
    normalize=False. Computed in float32, returned in the weights' dtype (numpy or jax)."""
    idx = np.asarray(representative_idx, np.int64)
    gate, up = w_gate[:, idx], w_up[:, idx]
    if normalize:
        gate, up = _unit_columns(gate), _unit_columns(up)
    return gate, up

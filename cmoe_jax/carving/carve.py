"""Carving one FFN layer: shared neurons, routed clusters, representative neurons, and the
weight slices of the resulting experts and analytical router."""
from __future__ import annotations

import dataclasses

import numpy as np

from cmoe_jax.carving.kmeans import balanced_kmeans, l2_distances
from cmoe_jax.carving.plan import MoEPlan


@dataclasses.dataclass
class LayerCarving:
    shared_idx: np.ndarray          # [x*m] neuron ids of the fused shared expert
    expert_idx: np.ndarray          # [N_r, m] neuron ids of each routed expert
    representative_idx: np.ndarray  # [N_r] the member closest to each cluster centroid
    iterations: int = 0             # balanced K-means assignment steps run


def top_mu(mu: np.ndarray, count: int, exclude: np.ndarray | None = None) -> np.ndarray:
    """Ids of the `count` highest activation rates (ties: lower id first)."""
    order = np.argsort(-np.asarray(mu, np.float64), kind="stable")
    if exclude is not None and len(exclude):
        order = order[~np.isin(order, exclude)]
    return order[:count]


def carve_layer(markers: np.ndarray, mu: np.ndarray, plan: MoEPlan, *, k_act: int = 10,
                kmeans_iters: int | None = None, seed: int = 0) -> LayerCarving:
    """Partition the d_h neurons of one layer from its markers [T, d_h] and rates mu [d_h].

    Shared: the x*m neurons with the highest mu. Routed: balanced K-means of the remaining
    neurons' marker columns, initialised at the N_r highest-mu remaining neurons. The method
    is deterministic; `seed` is recorded for the calibration sampling and kept for API
    stability.
    """
    d_h = markers.shape[1]
    plan.validate(d_h, k_act)
    m = plan.expert_width(d_h)
    shared = np.sort(top_mu(mu, plan.shared * m))
    rest = np.setdiff1d(np.arange(d_h), shared)           # sorted neuron ids
    init_ids = top_mu(mu, plan.routed, exclude=shared)     # neuron ids of the initial centroids
    init = np.searchsorted(rest, init_ids)                 # their rows among `rest`
    points = np.ascontiguousarray(np.asarray(markers)[:, rest].T, dtype=np.float32)
    km = balanced_kmeans(points, init, kmeans_iters)
    experts = np.stack([rest[km.labels == j] for j in range(plan.routed)])
    dist = l2_distances(points, points.sum(axis=1), km.centroids)
    reps = []
    for j in range(plan.routed):
        members = np.flatnonzero(km.labels == j)
        reps.append(rest[members[np.argmin(dist[members, j])]])  # argmin: lowest id on ties
    return LayerCarving(shared, experts, np.asarray(reps), km.iterations)


def _unit_columns(w: np.ndarray) -> np.ndarray:
    return w / np.maximum(np.linalg.norm(w, axis=0, keepdims=True), 1e-12)


def slice_ffn(w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray, carving: LayerCarving) -> dict:
    """Expert and router weights (JAX layout) cut from a dense SwiGLU FFN.

    With every routed expert active the experts sum to the dense FFN exactly: the carving is
    a permutation of its neurons. Router weights are the representative neurons' normalised
    gate/up columns.
    """
    s, e, r = carving.shared_idx, carving.expert_idx, carving.representative_idx
    return {
        "shared_gate": w_gate[:, s], "shared_up": w_up[:, s], "shared_down": w_down[s, :],
        "expert_gate": np.stack([w_gate[:, ids] for ids in e]),
        "expert_up": np.stack([w_up[:, ids] for ids in e]),
        "expert_down": np.stack([w_down[ids, :] for ids in e]),
        "router_gate": _unit_columns(w_gate[:, r]), "router_up": _unit_columns(w_up[:, r]),
    }

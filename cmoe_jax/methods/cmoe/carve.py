"""Carving one FFN layer: shared neurons, routed clusters, representative neurons, and the
weight slices of the resulting experts and analytical router."""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from cmoe_jax.carving.kmeans import balanced_kmeans, markers_to_points
from cmoe_jax.methods.cmoe.plan import MoEPlan
from cmoe_jax.methods.cmoe.router import representative_neurons, router_weights
from cmoe_jax.methods.cmoe.shared import split_shared


@dataclasses.dataclass
class LayerCarving:
    shared_idx: np.ndarray          # int64 [x*m] neuron ids of the fused shared expert (ascending)
    expert_idx: np.ndarray          # int64 [N_r, m] neuron ids of each routed expert (ascending rows)
    representative_idx: np.ndarray  # int64 [N_r, r] each expert's router neurons, best first
    iterations: int = 0             # balanced K-means assignment steps run
    timings: dict = dataclasses.field(default_factory=dict)  # seconds per stage
    kmeans_costs: list = dataclasses.field(default_factory=list)  # K-means objective per step


@dataclasses.dataclass(frozen=True)
class NeuronScores:
    """Per-neuron scores [d_h] that replace the paper's rules (None: the paper's rule)."""

    shared: np.ndarray | None = None           # the shared set is its top (paper: mu)
    representatives: np.ndarray | None = None  # router neurons: members of highest score (paper: closest to the centroid)
    ties: np.ndarray | None = None             # equal mu: the higher score first (paper: the lower id)


def carve_layer(markers, mu, plan: MoEPlan, *, k_act: int = 10, kmeans_iters: int | None = None,
                router_neurons: int = 1, scores: NeuronScores = NeuronScores()) -> LayerCarving:
    """Partition the d_h neurons of one layer from its binary markers [T, d_h] and rates mu [d_h].

    Shared: the x*m neurons with the highest `scores.shared` (default mu, the paper's rule). Routed: balanced
    K-means of the remaining neurons' marker columns into N_r clusters of exactly m, initialised at the
    N_r highest-mu remaining neurons (cluster j at the j-th; ties in either choice go to the
    higher `scores.ties`, then the lower id), each step an exact balanced
    assignment; `kmeans_iters` None runs to convergence, 1 is the authors' code. The
    representatives of each cluster are its `router_neurons` members closest to the centroid
    (1: the paper's single representative), or, given `scores.representatives`, its
    members of highest score (ties: lower id). Deterministic: the method has no random choice.
    """
    t_start = time.perf_counter()
    markers = np.asarray(markers)
    if markers.ndim != 2:
        raise ValueError(f"markers must be [T, d_h], got shape {markers.shape}")
    d_h = markers.shape[1]
    mu = np.asarray(mu)
    if mu.shape != (d_h,):
        raise ValueError(f"mu has shape {mu.shape}, markers have d_h={d_h}")
    plan.validate(d_h, k_act)
    m = plan.expert_width(d_h)
    shared, rest, init_ids = split_shared(mu, plan.shared_width(d_h), plan.routed, scores.shared,
                                          scores.ties)
    t_shared = time.perf_counter()
    points = markers_to_points(markers, rest)              # [n_routed, T] sparse
    km = balanced_kmeans(points, np.searchsorted(rest, init_ids), kmeans_iters)
    t_kmeans = time.perf_counter()
    # rest is ascending, so each cluster's members come out ascending
    experts = np.stack([rest[km.labels == j] for j in range(plan.routed)]).astype(np.int64)
    assert experts.shape == (plan.routed, m)
    if scores.representatives is None:
        reps = rest[representative_neurons(points, km.labels, km.centroid_counts, km.cluster_size,
                                           router_neurons)]
    else:
        reps = top_scored_members(experts, np.asarray(scores.representatives), router_neurons)
    t_end = time.perf_counter()
    timings = {"shared": t_shared - t_start, "kmeans": t_kmeans - t_shared,
               "assignment": km.assign_seconds, "representatives": t_end - t_kmeans,
               "total": t_end - t_start}
    return LayerCarving(shared.astype(np.int64), experts, reps.astype(np.int64), km.iterations,
                        timings, km.costs)


def top_scored_members(experts, score, per_expert: int) -> np.ndarray:
    """Per expert row of neuron ids [E, m], its `per_expert` ids of highest score, highest
    first (stable: equal scores keep the lower id first)."""
    order = np.argsort(-score[experts], axis=1, kind="stable")[:, :per_expert]
    return np.take_along_axis(experts, order, axis=1)


def slice_ffn(w_gate, w_up, w_down, carving: LayerCarving, normalize_router: bool = True) -> dict:
    """Expert and router weights (JAX layout, (in, out)) cut from a dense SwiGLU FFN.

    w_gate, w_up: [d, d_h]; w_down: [d_h, d] (numpy or jax, any float dtype, kept). Returns
    shared_gate/shared_up [d, S], shared_down [S, d], expert_gate/expert_up [E, d, m],
    expert_down [E, m, d], router_gate/router_up [d, E*r] (S = x*m, E = N_r, r router neurons
    per expert). With every routed
    expert active the experts sum to the dense FFN exactly: the carving is a permutation of
    its neurons. Router weights are the representative neurons' gate/up columns, unit-normed.
    """
    s = np.asarray(carving.shared_idx, np.int64)
    e = np.asarray(carving.expert_idx, np.int64)
    n_exp, m = e.shape
    d = w_gate.shape[0]
    if w_up.shape != w_gate.shape or w_down.shape != w_gate.shape[::-1]:
        raise ValueError(f"w_gate {w_gate.shape}, w_up {w_up.shape}, w_down {w_down.shape} are not "
                         "[d, d_h], [d, d_h], [d_h, d]")
    ids = np.sort(np.concatenate([s, e.reshape(-1)]))
    if len(ids) != w_gate.shape[1] or not np.array_equal(ids, np.arange(w_gate.shape[1])):
        raise ValueError(f"carving ids are not a permutation of the FFN's {w_gate.shape[1]} neurons")
    flat = e.reshape(-1)
    router_gate, router_up = router_weights(w_gate, w_up, carving.representative_idx, normalize_router)
    out = {
        "shared_gate": w_gate[:, s], "shared_up": w_up[:, s], "shared_down": w_down[s, :],
        "expert_gate": w_gate[:, flat].reshape(d, n_exp, m).transpose(1, 0, 2),
        "expert_up": w_up[:, flat].reshape(d, n_exp, m).transpose(1, 0, 2),
        "expert_down": w_down[flat, :].reshape(n_exp, m, d),
        "router_gate": router_gate, "router_up": router_up,
    }
    return {k: np.ascontiguousarray(v) if isinstance(v, np.ndarray) else v for k, v in out.items()}

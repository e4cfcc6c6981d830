"""ExpertWeaver (paper 002): weave one SwiGLU FFN into shared and routed experts.

From gate-only activation profiles of calibration samples grouped by task:

1. profile a_ij = mean over the tokens of sample j of |Swish(x W_gate)_i|;
2. per neuron, CV_i = std over tasks / (mean over tasks + eps) of its per-task mean profile;
   r = share of neurons with CV_i > tau, alpha = alpha_max - (alpha_max - alpha_min) r,
   N_se = round(round(alpha d_ffn) / d_expert) shared experts;
3. shared: the N_se d_expert neurons of highest mean profile; routed: balanced K-means of
   the remaining neurons' profile vectors into clusters of exactly d_expert neurons;
4. router column i = the mean of W_gate[:, j] over the neurons j of cluster i.

Pure numpy on small arrays ([d_ffn, samples]); `gate_profiles` is the one jitted pass over
the activations. Choices where the paper is silent are named where they are made.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from cmoe_jax.carving.assignment import balanced_assignment
from cmoe_jax.moe.activations import glu_activation

ASSIGNMENTS = ("greedy", "exact")


@functools.partial(jax.jit, static_argnames=("activation",))
def gate_profiles(x, w_gate, activation: str):
    """a [d_ffn, N]: per sample (x [N, T, d]) the token mean of |act(x W_gate)|, float32
    (act: the model's GLU activation, Swish in the paper)."""
    g = jnp.asarray(x, jnp.float32) @ jnp.asarray(w_gate, jnp.float32)
    return jnp.mean(jnp.abs(glu_activation(activation)(g)), axis=1).T


def coefficient_of_variation(profiles, task_ids, eps: float = 1e-6) -> np.ndarray:
    """CV_i over tasks of the per-task mean profile (population std, ddof=0: the paper is silent)."""
    profiles = np.asarray(profiles, np.float64)
    task_ids = np.asarray(task_ids)
    if profiles.ndim != 2 or profiles.shape[1] != len(task_ids):
        raise ValueError(f"profiles {profiles.shape} do not match {len(task_ids)} task ids")
    tasks = np.unique(task_ids)
    per_task = np.stack([profiles[:, task_ids == t].mean(axis=1) for t in tasks], axis=1)
    return per_task.std(axis=1) / (per_task.mean(axis=1) + eps)


def shared_ratio(cv, tau: float, alpha_min: float, alpha_max: float) -> tuple[float, float]:
    """(r, alpha): the share r of specialised neurons (CV > tau) and the shared ratio alpha."""
    r = float(np.mean(np.asarray(cv) > tau))
    return r, alpha_max - (alpha_max - alpha_min) * r


def shared_experts(alpha: float, d_ffn: int, num_experts: int) -> int:
    """N_se = round(round(alpha d_ffn) / d_expert) (the paper's eq. 6; numpy rounds half to even)."""
    d_expert = d_ffn // num_experts
    return int(np.round(np.round(alpha * d_ffn) / d_expert))


def active_experts(sparsity: float, num_experts: int) -> int:
    """k = round((1 - sparsity) N_e) experts active per token (shared included)."""
    return int(np.round((1.0 - sparsity) * num_experts))


def _greedy_balanced(dist: np.ndarray, capacity: int) -> np.ndarray:
    """The paper's greedy assignment: (point, cluster) pairs by increasing distance, each
    point to the nearest cluster that still has room (ties: lower point, then cluster id)."""
    n, k = dist.shape
    order = np.lexsort((np.tile(np.arange(k), n), np.repeat(np.arange(n), k), dist.ravel()))
    labels = np.full(n, -1, np.int64)
    room = np.full(k, capacity, np.int64)
    left = n
    for flat in order:
        i, j = divmod(int(flat), k)
        if labels[i] < 0 and room[j] > 0:
            labels[i], room[j], left = j, room[j] - 1, left - 1
            if left == 0:
                break
    return labels


def balanced_kmeans(points, k: int, *, assignment: str = "greedy", seed: int = 0,
                    max_iters: int = 100) -> tuple[np.ndarray, int]:
    """(labels [n], assignment steps): k clusters of exactly n / k real points [n, M].

    Initial centroids: k distinct points drawn with `numpy.random.default_rng(seed)` (the
    paper: sampled from the data). Each step assigns under the balance constraint, greedily
    (the paper) or exactly (minimum total squared distance, `balanced_assignment`), then
    moves each centroid to its members' mean; stops when the labels repeat or after max_iters.
    """
    points = np.asarray(points, np.float64)
    n = points.shape[0]
    if k < 1 or n % k:
        raise ValueError(f"{n} points cannot form {k} equal clusters")
    if assignment not in ASSIGNMENTS:
        raise ValueError(f"assignment must be one of {ASSIGNMENTS}, got {assignment!r}")
    centroids = points[np.random.default_rng(seed).choice(n, k, replace=False)]
    labels, it = None, 0
    sq = (points ** 2).sum(axis=1)
    while it < max_iters:
        dist = sq[:, None] - 2.0 * points @ centroids.T + (centroids ** 2).sum(axis=1)[None, :]
        new = (_greedy_balanced(dist, n // k) if assignment == "greedy"
               else balanced_assignment(dist, n // k))
        it += 1
        if labels is not None and np.array_equal(new, labels):
            break
        labels = new
        centroids = np.stack([points[labels == j].mean(axis=0) for j in range(k)])
    return labels, it


def router_centroids(w_gate, expert_idx) -> np.ndarray:
    """W_router [d, E]: column i is the mean of W_gate[:, j] over the neurons j of expert i."""
    w_gate = np.asarray(w_gate, np.float32)
    return np.stack([w_gate[:, row].mean(axis=1) for row in np.asarray(expert_idx)], axis=1)


@dataclasses.dataclass
class WovenLayer:
    """One layer's ExpertWeaver partition and the statistics that chose it."""

    shared_idx: np.ndarray   # int64 [N_se * d_expert] ascending
    expert_idx: np.ndarray   # int64 [N_e - N_se, d_expert] ascending rows
    cv_ratio: float          # r_l
    alpha: float             # alpha_l
    n_shared: int            # N_se,l
    iterations: int = 0      # balanced K-means steps
    cv_quantiles: tuple = ()  # CV at the 10/50/90/99th percentiles (why alpha is what it is)

    def to_json(self) -> dict:
        return {"shared": self.shared_idx.tolist(), "experts": self.expert_idx.tolist(),
                "r": self.cv_ratio, "alpha": self.alpha, "n_shared": self.n_shared,
                "kmeans_iterations": self.iterations, "cv_quantiles": list(self.cv_quantiles)}

    @classmethod
    def from_json(cls, d: dict) -> "WovenLayer":
        return cls(np.asarray(d["shared"], np.int64), np.asarray(d["experts"], np.int64), d["r"],
                   d["alpha"], d["n_shared"], d["kmeans_iterations"], tuple(d.get("cv_quantiles", ())))


def weave_layer(profiles, task_ids, cc, *, layer: int = 0, max_shared: int | None = None,
                shared_score=None) -> WovenLayer:
    """Partition one layer's d_ffn neurons from their profiles [d_ffn, N] (samples of `task_ids`)
    into `cc.experts` experts as `cc` (a `WeaveConfig`) says; `layer` offsets its seed.

    N_se follows the CV rule (`cc.tau`, `cc.alpha_min`, `cc.alpha_max`), capped at `max_shared`
    (the training-free mode needs at least one routed expert per token: k - 1); `cc.n_shared`
    fixes it instead (downcycling's uniform shared count). Shared neurons: highest mean profile
    (the paper), or highest `shared_score` [d_ffn] when given (e.g. output energy); ties:
    lower id. `cc.random_split`: the same sizes, but shared and routed neurons drawn at random
    (the downcycling ablation).
    """
    num_experts, n_shared, seed = cc.experts, cc.n_shared, cc.seed + layer
    profiles = np.asarray(profiles, np.float64)
    d_ffn = profiles.shape[0]
    if d_ffn % num_experts:
        raise ValueError(f"d_ffn={d_ffn} does not split into {num_experts} experts")
    d_expert = d_ffn // num_experts
    cv = coefficient_of_variation(profiles, task_ids)
    r, alpha = shared_ratio(cv, cc.tau, cc.alpha_min, cc.alpha_max)
    n_se = shared_experts(alpha, d_ffn, num_experts) if n_shared is None else n_shared
    n_se = min(n_se, num_experts - 1 if max_shared is None else max_shared)
    quantiles = tuple(float(q) for q in np.quantile(cv, [0.1, 0.5, 0.9, 0.99]))
    if cc.random_split:
        perm = np.random.default_rng(seed).permutation(d_ffn)
        experts = np.sort(perm[n_se * d_expert:].reshape(num_experts - n_se, d_expert), axis=1)
        return WovenLayer(np.sort(perm[:n_se * d_expert]).astype(np.int64), experts.astype(np.int64),
                          r, alpha, n_se, 0, quantiles)
    score = profiles.mean(axis=1) if shared_score is None else np.asarray(shared_score, np.float64)
    if score.shape != (d_ffn,):
        raise ValueError(f"shared_score has shape {score.shape}, expected ({d_ffn},)")
    order = np.argsort(-score, kind="stable")
    shared = np.sort(order[:n_se * d_expert]).astype(np.int64)
    rest = np.setdiff1d(np.arange(d_ffn), shared)
    labels, it = balanced_kmeans(profiles[rest], num_experts - n_se, assignment=cc.assignment, seed=seed)
    experts = np.stack([rest[labels == j] for j in range(num_experts - n_se)]).astype(np.int64)
    return WovenLayer(shared, experts, r, alpha, n_se, it, quantiles)

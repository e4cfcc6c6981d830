"""The four baselines, each with a uniform per-layer budget k = round((1 - rho) E).

- frequency pruning: keep the k experts most often in the calibration top-k sets; the others'
  router logits (CMoE router: scores) are masked to -inf before the top-k.
- REAP pruning: the same, ranked by REAP's saliency, mean over routed tokens of
  g_e(t) ||e(h_t)|| (= ConMoE's a_e).
- M-SMoE (Li et al. 2024): the k most frequent experts are the dominant ones; every other
  expert joins the dominant expert whose router-logit column is most cosine-similar, has its
  neurons permuted to match the dominant expert's (weight matching, `align_neurons`), and
  each group is merged by its usage-frequency-weighted average.
- HC-SMoE (Chen et al. 2025): average-linkage hierarchical clustering of the experts' mean
  outputs over all calibration tokens (Euclidean), cut at k clusters; each cluster merged
  by its usage-frequency-weighted average.
Merged layers keep every router slot: a slot routes to its group's merged expert.
"""
from __future__ import annotations

import numpy as np
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.optimize import linear_sum_assignment

from cmoe_jax.methods.conmoe.plan import ScopePlan, copy_plan, expert_weights
from cmoe_jax.methods.conmoe.scoring import budget, top

METHODS = ("frequency", "reap", "msmoe", "hcsmoe")


def prune_plan(layer: int, score: np.ndarray, k: int) -> ScopePlan:
    keep = top(score, k)
    slot = np.full(len(score), -1, np.int32)
    slot[keep] = np.arange(len(keep))
    plan = copy_plan([layer], keep, slot, len(score))
    plan.info = {"kept": keep.tolist(), "score": np.asarray(score, float).tolist()}
    return plan


def merge_plan(layer: int, groups: np.ndarray, freq: np.ndarray, perms=None) -> ScopePlan:
    """Table row g = usage-weighted average of the experts with `groups == g` (each with its
    neurons permuted by `perms[e]` first, when given)."""
    groups = np.asarray(groups)
    k = int(groups.max()) + 1
    w = np.asarray(freq, np.float64)
    mix = np.zeros((k, len(groups)))
    for g in range(k):
        members = groups == g
        weights = w[members] if w[members].sum() > 0 else np.ones(members.sum())
        mix[g, members] = weights / weights.sum()
    return ScopePlan([layer], mix, {layer: groups.astype(np.int32)},
                     {"groups": groups.tolist(), "freq": w.tolist()}, perms)


def align_neurons(anchor, member) -> np.ndarray:
    """M-SMoE's alignment by weight matching: the order `perm` of `member`'s neurons (its
    neuron perm[j] takes the anchor's neuron j's place) that maximises the summed inner
    products of their gate and up columns and down rows. `anchor`, `member`: [gate [d, m],
    up [d, m], down [m, d]]. One hidden layer, so one assignment problem solves it exactly."""

    def neurons(w):  # [m, 3d]: each neuron's incoming and outgoing weights
        return np.concatenate([w[0].T, w[1].T, w[2]], axis=1).astype(np.float64)

    _, perm = linear_sum_assignment(neurons(anchor) @ neurons(member).T, maximize=True)
    return perm.astype(np.int32)


def msmoe_plan(model, layer: int, st, k: int) -> ScopePlan:
    """Merged experts aligned to their dominant expert; in a hierarchical layer each
    sub-expert to the dominant family's sub-expert in the same position (`perms[e]` `[S, m]`),
    since a neuron may not move between sub-experts that are routed separately."""
    groups = msmoe_groups(st.freq, st.logit_gram, k)
    cores = top(np.asarray(st.freq, np.float64), k)
    ws = expert_weights(model, [layer])  # [n, S, ...] each
    subs = ws[0].shape[1]

    def aligned(e, core):
        perm = np.stack([align_neurons([w[core, j] for w in ws], [w[e, j] for w in ws])
                         for j in range(subs)])
        return perm[0] if subs == 1 else perm

    perms = {e: aligned(e, cores[g]) for e, g in enumerate(groups) if e != cores[g]}
    return merge_plan(layer, groups, st.freq, perms)


def msmoe_groups(freq: np.ndarray, logit_gram: np.ndarray, k: int) -> np.ndarray:
    cores = top(np.asarray(freq, np.float64), k)
    norm = np.sqrt(np.maximum(np.diag(logit_gram), 1e-30))
    cos = logit_gram / (norm[:, None] * norm[None, :])
    groups = np.argmax(cos[:, cores], axis=1)
    groups[cores] = np.arange(k)
    return groups


def hcsmoe_groups(mean_out: np.ndarray, k: int) -> np.ndarray:
    if k >= len(mean_out):
        return np.arange(len(mean_out))
    labels = fcluster(linkage(np.asarray(mean_out, np.float64), method="average",
                              metric="euclidean"), t=k, criterion="maxclust")
    _, first = np.unique(labels, return_index=True)  # relabel 0.. in order of first expert
    order = labels[np.sort(first)]
    return np.array([int(np.flatnonzero(order == l)[0]) for l in labels])


def baseline_plans(method: str, stats: dict, ratio: float, model=None) -> list[ScopePlan]:
    """Per-layer plans of a baseline; M-SMoE needs `model` (its alignment reads the weights)."""
    if method not in METHODS:
        raise ValueError(f"method {method!r} must be one of {', '.join(METHODS)}")
    if method == "msmoe" and model is None:
        raise ValueError("msmoe aligns the experts' neurons: pass the model")
    plans = []
    for layer in sorted(stats):
        st = stats[layer]
        k = budget(len(st.freq), ratio)
        if method == "frequency":
            plans.append(prune_plan(layer, st.freq.astype(np.float64), k))
        elif method == "reap":
            plans.append(prune_plan(layer, st.contrib, k))
        elif method == "msmoe":
            plans.append(msmoe_plan(model, layer, st, k))
        else:
            plans.append(merge_plan(layer, hcsmoe_groups(st.mean_out, k), st.freq))
    return plans

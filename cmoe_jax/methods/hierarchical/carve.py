"""Hierarchical CMoE carving: every expert of an MoE layer carved like a dense FFN (paper 001,
section 4.4), with the existing profile / shared split / balanced K-means / router code.

Expert i is profiled on the calibration tokens its layer's top-level router sends to it
(any of the k slots); when fewer than `min_tokens` reach it, on all tokens (`fallback`).
Token sets are padded with zero rows to a power of two so one jit compilation serves many
experts: a zero row has h = 0, so it adds nothing to the output energies or the router-fit
sums, and its markers are cut off before the rates are taken.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from cmoe_jax.methods.cmoe import LayerCarving, carve_profiled, slice_ffn
from cmoe_jax.calibration_pass.markers import profile_layer
from cmoe_jax.methods.cmoe import MoEPlan
from cmoe_jax.methods.cmoe import (gate_fit_sums, router_fit_sums, scale_router_up,
                                   solve_gate_scales)

# top-level router variables of a source MoEFFN -> their names in a HierMoEFFN
TOP_ROUTER_NAMES = {"router_kernel": "router_kernel", "router_gate": "top_gate",
                    "router_up": "top_up", "u": "top_u", "router_bias": "top_bias"}
# the host layer's always-on shared MLP and its sigmoid gate (Qwen2-MoE), copied unchanged
HOST_NAMES = ("shared_gate", "shared_up", "shared_down", "shared_gate_kernel")


@dataclasses.dataclass
class ExpertCarving:
    """One expert's carving plus what it was profiled on."""

    carving: LayerCarving
    tokens: int            # calibration tokens routed to the expert
    fallback: bool         # profiled on all tokens (too few routed to it)
    router_scales: np.ndarray | None = None


def padded(rows: np.ndarray, minimum: int = 16) -> np.ndarray:
    """`rows [n, d]` with zero rows appended up to the next power of two (>= minimum)."""
    size = max(minimum, 1 << max(0, int(np.ceil(np.log2(max(len(rows), 1))))))
    return np.concatenate([rows, np.zeros((size - len(rows), rows.shape[1]), rows.dtype)])


def expert_tokens(x: np.ndarray, top_ids: np.ndarray, expert: int, min_tokens: int):
    """(tokens of `x [T, d]` routed to `expert` by `top_ids [T, k]`, their count, fallback)."""
    chosen = np.flatnonzero((top_ids == expert).any(axis=1))
    if len(chosen) < min_tokens:
        return x, len(chosen), True
    return x[chosen], len(chosen), False


def carve_expert(rows: np.ndarray, w_gate, w_up, w_down, cc, activation: str) -> LayerCarving:
    """The dense carving (`carve_profiled`) of one expert's SwiGLU on its tokens `rows [n, d]`.

    `cc`: a `ConvertConfig` (its plan the per-expert plan) read exactly as the dense pipeline
    reads it; `activation`: the experts' GLU activation."""
    n = len(rows)
    markers, mu, energy = profile_layer(padded(rows), w_gate, w_up, w_down, k_act=cc.k_act,
                                        normalize=cc.normalize, activation=activation)
    markers = np.asarray(markers)[:n]
    mu = markers.mean(axis=0, dtype=np.float64).astype(np.float32)
    energy = np.asarray(energy, np.float64) * (len(padded(rows)) / n)  # mean over the real rows
    return carve_profiled(markers, mu, energy, cc, cc.plan)


def sub_expert_slices(w_gate, w_up, w_down, carving: LayerCarving, plan: MoEPlan) -> dict:
    """One expert's sub-experts stacked shared-first, `gate/up [N', d, m']`, `down [N', m', d]`,
    and its sub-router `router_gate/router_up [d, N'_r*r]` (from `slice_ffn`)."""
    s = slice_ffn(w_gate, w_up, w_down, carving)
    m = s["expert_gate"].shape[2]
    d = w_gate.shape[0]
    shared_in = lambda w: w.reshape(d, plan.shared, m).transpose(1, 0, 2)
    return {"gate": np.concatenate([shared_in(s["shared_gate"]), s["expert_gate"]]),
            "up": np.concatenate([shared_in(s["shared_up"]), s["expert_up"]]),
            "down": np.concatenate([s["shared_down"].reshape(plan.shared, m, d), s["expert_down"]]),
            "router_gate": s["router_gate"], "router_up": s["router_up"]}


def fit_sub_router(rows: np.ndarray, sub: dict, plan: MoEPlan, fit_tokens: int,
                   activation: str):
    """Fold the least-squares score scales of one sub-router into its `router_up` (returns
    the new router_up and the scales), fitted on about `fit_tokens` evenly strided rows."""
    stride = max(1, -(-len(rows) // fit_tokens))
    routed = slice(plan.shared, None)
    num, den = router_fit_sums(jnp.asarray(padded(rows[::stride])), sub["router_gate"], sub["router_up"],
                               sub["gate"][routed], sub["up"][routed], sub["down"][routed],
                               activation=activation)
    return scale_router_up(sub["router_up"], num, den, plan.routed)


def carve_moe_layer(x: np.ndarray, top_ids: np.ndarray, weights: dict, cc, *,
                    min_tokens: int, done: list[ExpertCarving] | None = None, progress=None,
                    activation: str):
    """(HierMoEFFN variables of the carved experts, [ExpertCarving] per expert).

    `cc`: the conversion's `ConvertConfig`, `cc.plan` the per-expert plan.
    `x [T, d]` the layer's FFN inputs, `top_ids [T, k]` their top-level experts, `weights`
    the source layer's `expert_gate/expert_up [N, d, d_e]`, `expert_down [N, d_e, d]` (numpy
    float32). `done`: carvings of a previous run (resume): only slicing and fitting re-run.
    Returns `expert_gate/up/down [N*N', ...]`, `sub_gate/sub_up [N, d, N'_r*r]`, the gate
    scales `u` (fitted with `cc.gate_fit`, else zeros) and `router_bias` zeros `[N, N'_r]`."""
    plan = cc.plan
    num_experts, d, d_e = weights["expert_gate"].shape
    n_sub, m = plan.total, plan.expert_width(d_e)
    cols = plan.routed * cc.router_neurons
    # filled in place, expert by expert, in the weights' dtype: peak memory stays near one
    # copy of the layer
    dt = weights["expert_gate"].dtype
    out = {"expert_gate": np.empty((num_experts * n_sub, d, m), dt),
           "expert_up": np.empty((num_experts * n_sub, d, m), dt),
           "expert_down": np.empty((num_experts * n_sub, m, d), dt),
           "sub_gate": np.empty((num_experts, d, cols), dt),
           "sub_up": np.empty((num_experts, d, cols), dt),
           "u": np.zeros((num_experts, plan.routed), np.float32)}
    records = []
    for i in range(num_experts):
        w = [np.asarray(weights["expert_" + p][i], np.float32) for p in ("gate", "up", "down")]
        rows, count, fallback = expert_tokens(x, top_ids, i, min_tokens)
        carving = (done[i].carving if done is not None
                   else carve_expert(rows, *w, cc, activation))
        sub = sub_expert_slices(*w, carving, plan)
        scales = None
        if cc.router_scale:
            sub["router_up"], scales = fit_sub_router(rows, sub, plan, cc.router_fit_tokens,
                                                      activation)
        out["u"][i] = (fit_sub_gates(rows, sub, plan, cc.router_fit_tokens, activation)
                       if cc.gate_fit else 0.0)
        for p in ("gate", "up", "down"):
            out["expert_" + p][i * n_sub:(i + 1) * n_sub] = sub[p]
        out["sub_gate"][i], out["sub_up"][i] = sub["router_gate"], sub["router_up"]
        records.append(ExpertCarving(carving, count, fallback, scales))
        if progress is not None:
            progress(i)
    out["router_bias"] = np.zeros((num_experts, plan.routed), np.float32)
    return out, records


def random_moe_layer(weights: dict, plan: MoEPlan, router_neurons: int, seed: int):
    """Baseline at equal active width: each expert's neurons split into N' random sub-experts
    of m' (the first N'_s shared), with a random sub-router (unit-normed Gaussian columns, so
    the choice of the N'_k routed sub-experts carries no information about them)."""
    rng = np.random.default_rng(seed)
    n, d, d_e = weights["expert_gate"].shape
    m = plan.expert_width(d_e)
    perm = np.stack([rng.permutation(d_e) for _ in range(n)]).reshape(n, plan.total, m)
    take = lambda w, axis: np.stack([np.take(w[i], perm[i], axis=axis) for i in range(n)])
    gate = take(np.asarray(weights["expert_gate"], np.float32), 1)    # [n, d, N', m]
    up = take(np.asarray(weights["expert_up"], np.float32), 1)
    down = take(np.asarray(weights["expert_down"], np.float32), 0)    # [n, N', m, d]
    cols = plan.routed * router_neurons
    unit = lambda a: (a / np.linalg.norm(a, axis=1, keepdims=True)).astype(np.float32)
    return {"expert_gate": gate.transpose(0, 2, 1, 3).reshape(n * plan.total, d, m),
            "expert_up": up.transpose(0, 2, 1, 3).reshape(n * plan.total, d, m),
            "expert_down": down.reshape(n * plan.total, m, d),
            "sub_gate": unit(rng.standard_normal((n, d, cols))),
            "sub_up": unit(rng.standard_normal((n, d, cols))),
            "u": np.zeros((n, plan.routed), np.float32),
            "router_bias": np.zeros((n, plan.routed), np.float32)}


def fit_sub_gates(rows: np.ndarray, sub: dict, plan: MoEPlan, fit_tokens: int,
                  activation: str) -> np.ndarray:
    """The least-squares gate scales u [N'_r] of one expert's sub-router (`gate_fit_sums`),
    on the same strided rows as its score scales (so after them)."""
    stride = max(1, -(-len(rows) // fit_tokens))
    routed = slice(plan.shared, None)
    ata, atr = gate_fit_sums(jnp.asarray(padded(rows[::stride])), (sub["router_gate"], sub["router_up"], None),
                             (sub["gate"][routed], sub["up"][routed], sub["down"][routed]),
                             top_k=plan.active, activation=activation)
    return solve_gate_scales(ata, atr).astype(np.float32)

"""Exact balanced assignment at Llama-2-7B scale: ours vs the papers' repeated-column LSA.

    python benchmarks/assignment.py [--scale 1.0] [--tokens 16384] [--seed 0]

d_h = 11008 with S1A1E8: 9632 routed neurons, 7 clusters of 1376. Markers of 16384 tokens
with K_a = 10 active neurons each, drawn from a long-tailed (log-normal) per-neuron rate like
the papers' activation-rate figure. Costs are the L2 distances of every neuron's marker
column to the 7 initial centroids (the highest-rate neurons), as in the first K-means step.
Both solvers run in the same process; their optimal costs must agree. The last line is the
speed ratio `NN.Nx`.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def markers(n_neurons: int, tokens: int, k_act: int, rng) -> np.ndarray:
    rates = rng.lognormal(mean=0.0, sigma=1.5, size=n_neurons)
    p = rates / rates.sum()
    out = np.zeros((tokens, n_neurons), dtype=np.float32)
    # Gumbel top-k == sampling k neurons without replacement proportionally to p
    for start in range(0, tokens, 2048):
        g = np.log(p)[None] - np.log(-np.log(rng.random((min(2048, tokens - start), n_neurons))))
        top = np.argpartition(-g, k_act, axis=1)[:, :k_act]
        np.put_along_axis(out[start:start + len(top)], top, 1.0, axis=1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the 11008 neurons (quick runs)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--k-act", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from cmoe_jax.carving import MoEPlan, assignment_cost, balanced_assignment, repeated_column_reference
    from cmoe_jax.carving.kmeans import l2_distances

    plan = MoEPlan.parse("S1A1E8")
    d_h = int(round(11008 * args.scale / 8)) * 8
    m = d_h // 8
    rng = np.random.default_rng(args.seed)
    mk = markers(d_h, args.tokens, args.k_act, rng)
    mu = mk.mean(axis=0)
    order = np.argsort(-mu, kind="stable")
    routed = np.sort(order[m:])                       # S1: the top m neurons are shared
    points = np.ascontiguousarray(mk[:, routed].T)
    init = np.searchsorted(routed, order[m:m + plan.routed])
    cost = l2_distances(points, points.sum(axis=1), points[init])
    print(f"neurons {len(routed)}, clusters {plan.routed} x {m}, tokens {args.tokens}, K_a {args.k_act}")

    balanced_assignment(cost[:14, :7] if len(cost) >= 14 else cost)  # numba compile (cached on disk)
    t0 = time.perf_counter()
    ours = balanced_assignment(cost)
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = repeated_column_reference(cost)
    t_ref = time.perf_counter() - t0
    c_ours, c_ref = assignment_cost(cost, ours), assignment_cost(cost, ref)
    print(f"ours (SSP over {plan.routed} clusters): {t_ours:8.3f} s  cost {c_ours:.6f}")
    print(f"reference (LSA on {len(routed)}x{len(routed)}): {t_ref:8.3f} s  cost {c_ref:.6f}")
    if abs(c_ours - c_ref) > 1e-6 * max(1.0, abs(c_ref)):
        raise SystemExit(f"optimal costs differ: {c_ours} vs {c_ref}")
    print("same optimal cost: yes")
    print(f"speedup: {t_ref / t_ours:.1f}x")


if __name__ == "__main__":
    main()

"""Exact balanced assignment at Llama-2-7B scale: ours vs the papers' repeated-column LSA.

    python benchmarks/assignment.py [--scale 1.0] [--tokens 16384] [--k-act 10] [--seed 0]
                                    [--sigma 2.0] [--repeats 5] [--kmeans]

d_h = 11008 with S1A1E8: 9632 routed neurons, 7 clusters of 1376. Markers of 16384 tokens
with K_a = 10 active neurons each: per-neuron rates are log-normal (long-tailed like the
papers' activation-rate figure: most neurons rarely active, a few almost always), and each
token draws its 10 neurons without replacement proportionally to the rates (Gumbel top-k).
The cost matrix is the first K-means step's: distances of every routed neuron's marker
column to the 7 initial centroids (the highest-rate routed neurons). Squared L2, i.e. the
Hamming distance on these binary columns (what the authors' L1 cdist computes). --step t
takes the t-th step's matrix instead (real-valued distances to the member means).

Both solvers run in the same process on the same matrix; their optimal costs must agree.
After a warm-up (numba compile, cached on disk; one untimed run of each) they alternate
(reference, ours, ...) --repeats times (`benchmarks/harness.py`): the reference builds the
n x n repeated-column matrix and runs scipy's linear_sum_assignment (matrix construction
included). Prints median and min per side, the load average at start and end, and last
`ratio (...): N.NNx` = reference time / our time of the medians, withheld when the load
average exceeds the core count. --kmeans also times a whole carve_layer (K-means to
convergence, once).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import interleaved_times, load_average, report  # noqa: E402


def synthetic_markers(n_neurons: int, tokens: int, k_act: int, rng, sigma: float = 2.0) -> np.ndarray:
    """bool [tokens, n_neurons]: k_act neurons per token, drawn without replacement
    proportionally to log-normal per-neuron rates."""
    log_p = rng.normal(0.0, sigma, size=n_neurons)
    out = np.zeros((tokens, n_neurons), dtype=bool)
    for start in range(0, tokens, 1024):  # Gumbel top-k == sampling without replacement
        rows = min(1024, tokens - start)
        g = log_p[None] - np.log(-np.log(rng.random((rows, n_neurons))))
        top = np.argpartition(-g, k_act, axis=1)[:, :k_act]
        np.put_along_axis(out[start:start + rows], top, True, axis=1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the 11008 neurons (quick runs)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--k-act", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats of each solver")
    ap.add_argument("--sigma", type=float, default=2.0, help="log-normal spread of the per-neuron rates")
    ap.add_argument("--step", type=int, default=1,
                    help="K-means step whose cost matrix is solved (1: the initial centroids; "
                         "later steps: real-valued distances to member means)")
    ap.add_argument("--kmeans", action="store_true", help="also time carve_layer (K-means to convergence)")
    args = ap.parse_args()
    load_start = load_average()

    from cmoe_jax.methods.cmoe import MoEPlan, carve_layer, split_shared
    from cmoe_jax.carving import assignment_cost, balanced_assignment, balanced_kmeans, markers_to_points, repeated_column_reference, squared_distances

    plan = MoEPlan.parse("S1A1E8")
    d_h = max(1, int(round(11008 * args.scale / plan.total))) * plan.total
    m = plan.expert_width(d_h)
    rng = np.random.default_rng(args.seed)
    markers = synthetic_markers(d_h, args.tokens, args.k_act, rng, args.sigma)
    mu = markers.mean(axis=0)
    shared, routed, init_ids = split_shared(mu, plan.shared_width(d_h), plan.routed)
    points = markers_to_points(markers, routed)
    init = np.searchsorted(routed, init_ids)
    if args.step <= 1:
        cost = squared_distances(points, np.asarray(points[init].T.toarray(), np.int64), 1)
    else:
        km = balanced_kmeans(points, init, max_iters=args.step - 1)
        cost = squared_distances(points, km.centroid_counts, km.cluster_size)
    n = len(routed)
    print(f"d_h {d_h}, {plan.name}: {n} routed neurons, {plan.routed} clusters x {m}, "
          f"{args.tokens} tokens, K_a {args.k_act}, K-means step {max(1, args.step)}")
    print(f"rates: max {mu.max():.3f}, median {np.median(mu):.5f}, shared mean {mu[shared].mean():.3f}; "
          f"distances {cost.min():.1f}..{cost.max():.1f} ({len(np.unique(cost))} distinct values)")

    balanced_assignment(cost[: 2 * plan.routed])  # warm-up: numba compile / load from cache
    out = {}
    times = interleaved_times([lambda: out.__setitem__("ref", repeated_column_reference(cost)),
                               lambda: out.__setitem__("ours", balanced_assignment(cost))],
                              max(1, args.repeats))
    ours, ref = out["ours"], out["ref"]
    c_ours, c_ref = assignment_cost(cost, ours), assignment_cost(cost, ref)
    assert np.bincount(ours, minlength=plan.routed).tolist() == [m] * plan.routed
    print(f"cost: ours (SSP over {plan.routed} clusters) {c_ours:.6f}, reference (LSA on {n}x{n} "
          f"repeated columns) {c_ref:.6f}")
    if abs(c_ours - c_ref) > 1e-9 * abs(c_ref):  # exact on step 1's integer costs
        raise SystemExit(f"optimal costs differ: {c_ours} vs {c_ref}")
    print(f"same optimal cost: yes ({np.mean(ours != ref):.1%} of neurons differ in label: tied optima)")
    if args.kmeans:
        c = carve_layer(markers, mu, plan, k_act=args.k_act)
        t = c.timings
        print(f"carve_layer to convergence: {c.iterations} steps, {t['total']:.2f} s "
              f"(assignment {t['assignment']:.2f} s, K-means {t['kmeans']:.2f} s); "
              f"objective {c.kmeans_costs[0]:.0f} -> {c.kmeans_costs[-1]:.0f}")
    report(["reference (LSA)", "ours (SSP)"], times, load_start, work=None)


if __name__ == "__main__":
    main()

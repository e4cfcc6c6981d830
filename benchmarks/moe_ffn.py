"""MoE FFN vs the dense SwiGLU FFN with the same neurons, on the current JAX platform.

Configuration SxAyEz (CMoE paper): the dense FFN of width d_h is cut into z experts of width
m = d_h / z; x of them form the shared MLP (width x*m), the other z - x are routed and each
token uses y of them (top_k = y). Active fraction (x + y) / z, so the ideal speedup is
z / (x + y) (S1A1E8: 4x, S3A3E8: 1.33x).

Routing is controlled exactly: the MoE runs a real router whose scores get a constructed
offset that fixes the selection. With `--router-neurons r` (default 8, the conversion
default) it is the CMoE router of a converted model: r representative neurons per routed
expert, s = sum |silu(x W_gate^R) * (x W_up^R)| (`cmoe_jax.moe.routers.cmoe_scores`), so its
cost (2 x d x r(z - x) multiply-adds per token) is counted; `--router-neurons 0` runs a
linear router (x @ W_r) instead. The offsets: "balanced" gives every
routed expert T*y/(z-x) rows, "skewed" sends half the tokens' first choice to expert 0.
Each printed row names configuration, shape, tokens, dtype and routing, gives the median
(and min) times of the dense FFN, the MoE FFN (grouped-matmul backend of the platform, or
--backend) and the same MoE with `jax.lax.ragged_dot`, interleaved over --reps after a
warm-up (`benchmarks/harness.py`), and ends with dense-time / MoE-time of the medians as
`N.NNx` (withheld when the load average at start exceeds the core count).

    python benchmarks/moe_ffn.py --shape 4096x11008 --tokens 4096 --dtype fp32 --config S1A1E8
    python benchmarks/moe_ffn.py --backend pallas_gpu --shape 4096x11008 --dtype bf16   # on a GPU
    python benchmarks/moe_ffn.py --backend megablox_tpu --shape 4096x11008 --dtype bf16 # on a TPU
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import interleaved_times, load_average, machine_busy  # noqa: E402

LOAD_AT_START = load_average()
from cmoe_jax.moe.dispatch import GLUExperts, routed_experts
from cmoe_jax.moe.gmm import BACKENDS, get_gmm, resolve_backend
from cmoe_jax.moe.routers import cmoe_scores

CONFIGS = ("S1A1E8", "S1A3E16", "S3A3E8", "S3A9E16")
SHAPES = ("576x1536", "4096x11008")
TOKENS = (512, 4096, 16384)
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def parse_config(name: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"S(\d+)A(\d+)E(\d+)", name)
    if not m:
        raise SystemExit(f"bad configuration {name!r}: expected SxAyEz, e.g. S1A1E8")
    return tuple(int(g) for g in m.groups())


def routing_offsets(tokens: int, routed: int, top_k: int, skewed: bool) -> np.ndarray:
    """[T, R] logit offsets that make top_k pick a fixed, exactly known set per token."""
    ids = (np.arange(tokens)[:, None] * top_k + np.arange(top_k)[None, :]) % routed
    if skewed:  # first half of the tokens: expert 0 first, the rest spread over the others
        half = tokens // 2
        others = (np.arange(half)[:, None] * (top_k - 1) + np.arange(top_k - 1)[None, :]) % (routed - 1) + 1
        ids[:half] = np.concatenate([np.zeros((half, 1), np.int64), others], axis=1)
    off = np.zeros((tokens, routed), np.float32)
    np.put_along_axis(off, ids, 1.0 + top_k - np.arange(top_k, dtype=np.float32), axis=1)
    return off


def swiglu(x, wg, wu, wd):
    return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def router_scores(x, router, num_experts: int):
    """CMoE representative-neuron scores for a (gate, up) pair, linear logits for a matrix."""
    if isinstance(router, tuple):
        return cmoe_scores(x, *router, num_experts, activation="silu")
    return x.astype(jnp.float32) @ router


def make_moe(top_k: int, gmm, num_experts: int):
    def moe(x, shared, experts, router, offsets):
        logits = router_scores(x, router, num_experts) + offsets
        gates, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
        routed, counts = routed_experts(x, ids.astype(jnp.int32), gates, GLUExperts(*experts, gmm, "silu"))
        return (swiglu(x, *shared).astype(jnp.float32) + routed).astype(x.dtype), counts
    return jax.jit(moe)


def run_case(config, shape, tokens, dtype_name, routing, backend, reps, ragged_limit, router_neurons=8):
    s, a, z = parse_config(config)
    d, dh = (int(v) for v in shape.split("x"))
    if dh % z:
        raise SystemExit(f"d_h={dh} is not divisible by {z} experts")
    m, routed = dh // z, z - s
    dtype = DTYPES[dtype_name]
    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    w = lambda k, *sh: (jax.random.normal(k, sh, jnp.float32) * 0.02).astype(dtype)
    x = w(keys[0], tokens, d) * 50

    dense = (w(keys[1], d, dh), w(keys[2], d, dh), w(keys[3], dh, d))
    shared = (w(keys[4], d, s * m), w(keys[5], d, s * m), w(keys[6], s * m, d))
    ek = jax.random.split(keys[7], 3)
    experts = (w(ek[0], routed, d, m), w(ek[1], routed, d, m), w(ek[2], routed, m, d))
    # tiny router weights: the scores stay << 1, so the offsets decide top_k
    rk = jax.random.split(keys[6], 2)
    if router_neurons:
        router = tuple(jax.random.normal(k, (d, routed * router_neurons), jnp.float32) * (1e-2 / d)
                       for k in rk)
    else:
        router = jax.random.normal(keys[7], (d, routed), jnp.float32) * (1e-3 / d)
    offsets = jnp.asarray(routing_offsets(tokens, routed, a, routing == "skewed"))

    moe = make_moe(a, get_gmm(backend), routed)
    counts = np.asarray(moe(x, shared, experts, router, offsets)[1])
    want = np.bincount(np.asarray(jax.lax.top_k(offsets, a)[1]).ravel(), minlength=routed)
    assert np.array_equal(counts, want), (counts, want)  # routing is what we asked for
    moe_args = (x, shared, experts, router, offsets)
    calls = [(jax.jit(swiglu), (x, *dense)), (moe, moe_args)]
    # ragged_dot on CPU computes every group for every row: skip when that is too slow
    ragged_flop = 6 * tokens * a * d * m * routed
    if ragged_limit > 0 and ragged_flop <= ragged_limit * 1e12:
        calls.append((make_moe(a, get_gmm("ragged_dot"), routed), moe_args))
    times = interleaved_times([lambda fn=fn, xs=xs: jax.block_until_ready(fn(*xs)) for fn, xs in calls], reps)
    (t_dense, t_moe, *t_ragged), mins = map(statistics.median, times), [min(ts) for ts in times]
    t_ragged = f"{t_ragged[0]:8.4f}s (min {mins[2]:.4f})" if t_ragged else "       -"
    loads = f"max/mean load {counts.max() / counts.mean():.2f}"
    busy = machine_busy(LOAD_AT_START)
    ratio = f"(load {LOAD_AT_START:.1f} at start: machine busy, no ratio)" if busy else f"{t_dense / t_moe:.2f}x"
    print(f"{config:8s} {shape:>10s} tokens={tokens:<6d} {dtype_name:4s} {routing:8s} r={router_neurons} "
          f"{loads}  dense {t_dense:8.4f}s (min {mins[0]:.4f})  moe {t_moe:8.4f}s (min {mins[1]:.4f})  "
          f"ragged_dot {t_ragged}  "
          f"{ratio}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", nargs="+", default=list(CONFIGS))
    p.add_argument("--shape", nargs="+", default=list(SHAPES), help="d_model x d_h, e.g. 4096x11008")
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    p.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--routing", nargs="+", default=["balanced"], choices=["balanced", "skewed"],
                   help="skewed: half the tokens on one expert")
    p.add_argument("--skewed-case", action="store_true",
                   help="also run the first selected configuration with skewed routing")
    p.add_argument("--backend", default="auto", choices=("auto",) + BACKENDS,
                   help="grouped-matmul backend of the MoE column: pallas_gpu, megablox_tpu, "
                        "ragged_dot, dense, cpu (auto: the platform's)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    p.add_argument("--router-neurons", type=int, default=8,
                   help="CMoE router neurons per routed expert (0: a linear router)")
    p.add_argument("--ragged-limit-tflop", type=float, default=1.0,
                   help="skip the ragged_dot column above this much work (0: never run it)")
    args = p.parse_args(argv)
    print(f"# platform {jax.default_backend()} ({jax.device_count()} device(s)), "
          f"MoE backend {resolve_backend(args.backend)}, median and min of {args.reps} interleaved runs, "
          f"load average {LOAD_AT_START:.2f} at start ({os.cpu_count()} cores)", flush=True)
    for shape, tokens, dtype_name in itertools.product(args.shape, args.tokens, args.dtype):
        for config, routing in itertools.product(args.config, args.routing):
            run_case(config, shape, tokens, dtype_name, routing, args.backend, args.reps,
                     args.ragged_limit_tflop, args.router_neurons)
        if args.skewed_case and "skewed" not in args.routing:
            run_case(args.config[0], shape, tokens, dtype_name, "skewed", args.backend,
                     args.reps, args.ragged_limit_tflop, args.router_neurons)
    print(f"# load average at end {load_average():.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

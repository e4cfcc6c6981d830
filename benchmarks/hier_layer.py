"""Hierarchical CMoE conversion of one Qwen3-30B-A3B-shaped MoE layer with random weights
(128 experts of d_e = 768, top-8, d = 2048): per-layer time by stage and peak memory.

The baseline measured in the same run is one forward of the source layer over the same
calibration tokens (what any layer-by-layer conversion pays at least), so the conversion
time is also printed as a multiple of it.

    python benchmarks/hier_layer.py [--tokens 2048] [--config S1A1E4] [--experts 128]
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.harness import load_average  # noqa: E402
from cmoe_jax.methods.cmoe import MoEPlan  # noqa: E402
from cmoe_jax.convert import ConvertConfig  # noqa: E402
from cmoe_jax.methods.hierarchical import build_hier_ffn, carve_moe_layer, hier_spec  # noqa: E402
from cmoe_jax.models import FFNSpec  # noqa: E402
from cmoe_jax.moe import MoEFFN  # noqa: E402


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048, help="calibration tokens")
    p.add_argument("--config", default="S1A1E4", help="per-expert plan S'A'E'")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--expert-width", type=int, default=768)
    p.add_argument("--router-neurons", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", help="weights (Qwen3-30B-A3B ships bf16)")
    args = p.parse_args()
    load_start = load_average()
    print(f"load average at start {load_start:.2f} on {os.cpu_count()} cores")
    n, d, d_e, k = args.experts, args.d_model, args.expert_width, args.top_k
    t0 = time.perf_counter()
    dtype = jnp.dtype(args.dtype)
    src = nnx.eval_shape(lambda: MoEFFN(d_model=d, expert_width=d_e, num_experts=n, top_k=k, router="linear", norm_topk_prob=True,
                                        dtype=dtype, param_dtype=dtype, activation="silu", rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    for name, shape in (("expert_gate", (n, d, d_e)), ("expert_up", (n, d, d_e)),
                        ("expert_down", (n, d_e, d)), ("router_kernel", (d, n))):
        w = np.empty(shape, dtype)  # filled an expert at a time: no float32 copy of the layer
        for i in range(shape[0]):
            w[i] = (0.02 * rng.standard_normal(shape[1:], np.float32)).astype(dtype)
        setattr(src, name, nnx.Param(jnp.asarray(w)))
        del w
    x = jax.random.normal(jax.random.key(1), (args.tokens, d), jnp.float32)
    print(f"random layer built in {time.perf_counter() - t0:.1f} s, peak RSS {peak_gib():.2f} GiB")

    fwd = jax.jit(lambda g, s, x: nnx.merge(g, s)(x))
    g, s = nnx.split(src)
    fwd(g, s, x).block_until_ready()
    t0 = time.perf_counter()
    fwd(g, s, x).block_until_ready()
    t_forward = time.perf_counter() - t0

    cc = ConvertConfig(plan=MoEPlan.parse(args.config), router_neurons=args.router_neurons)
    t0 = time.perf_counter()
    top_ids = np.asarray(src.route(x)[0])
    xs = np.asarray(x)
    # the layer's own arrays: carve_moe_layer reads them one expert at a time (no full copy)
    weights = {k_: getattr(src, k_)[...] for k_ in ("expert_gate", "expert_up", "expert_down")}
    t_route = time.perf_counter() - t0
    t0 = time.perf_counter()
    carved, records = carve_moe_layer(xs, top_ids, weights, cc, min_tokens=32, activation="silu")
    t_carve = time.perf_counter() - t0
    for k_ in weights:  # the source experts are not needed any more: free them before building
        setattr(src, k_, nnx.Param(jnp.zeros((1,), dtype)))
    del weights
    t0 = time.perf_counter()
    spec = hier_spec(FFNSpec(n, k, d_e, 0, "linear", True), cc)
    cfg = types.SimpleNamespace(hidden_size=d)  # all the builder reads of a model config
    hier = build_hier_ffn(cfg, src, spec, carved, dtype)
    t_build = time.perf_counter() - t0
    total = t_route + t_carve + t_build
    fallback = sum(r.fallback for r in records)
    tokens = [r.tokens for r in records]
    kmeans = sum(r.carving.timings.get("kmeans", 0) for r in records)
    print(f"layer: {n} experts of d_e={d_e}, top-{k}, d={d}; plan {cc.plan.name} per expert; "
          f"{args.tokens} calibration tokens (per expert min {min(tokens)}, median "
          f"{int(np.median(tokens))}, {fallback} experts fell back to all tokens)")
    print(f"conversion time per layer: {total:.1f} s (route {t_route:.1f}, carve {t_carve:.1f} of which "
          f"K-means {kmeans:.1f}, build {t_build:.1f}); source layer forward on the same tokens "
          f"{t_forward:.2f} s (conversion = {total / t_forward:.0f}x one forward)")
    print(f"peak RSS {peak_gib():.2f} GiB (source layer {3 * n * d * d_e * dtype.itemsize / 2**30:.2f} GiB {dtype.name})")
    y = jax.jit(lambda g, s, x: nnx.merge(g, s)(x))(*nnx.split(hier), x[:256])
    print(f"converted layer runs: output {y.shape}, finite {bool(jnp.isfinite(y).all())}")
    print(f"load average at end {load_average():.2f}")


if __name__ == "__main__":
    main()

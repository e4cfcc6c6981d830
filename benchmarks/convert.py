"""Wall time of a full CMoE conversion of SmolLM2-135M, split by stage (model loading excluded).

    python benchmarks/convert.py [--config S1A1E8] [--calib-samples 8] [--seqlen 2048]

Prints one line per stage and, last, the total conversion time; also the process's peak
host memory (ru_maxrss), which is what the README quotes. With `--floor`, first times the
per-layer steps that any conversion must run (the calibration pass's attention, the FFN
profile, the converted FFN's forward) on one layer in isolation, best of 3, to show where the
time goes and what 30 layers of them cost.
"""
from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _best_of(fn, repeats: int = 3) -> float:
    import jax

    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return min(times)


def layer_floor(model: str, plan, samples: int, seqlen: int) -> None:
    """Seconds per layer of the steps every conversion runs, on layer 0 of `model` (random
    token ids: the cost does not depend on them), and that times the number of layers."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from cmoe_jax.carving import carve_layer
    from cmoe_jax.carving.markers import profile_layer
    from cmoe_jax.convert.pipeline import ConvertConfig, build_moe_ffn, slices_for
    from cmoe_jax.loading import load_model
    from cmoe_jax.profiling.layerwise import (attention_step, calibration_mesh, embed_step,
                                              ffn_residual_step, replicate, shard_batch)

    dense = load_model(model, dtype=jnp.float32, progress=False).model
    cfg, cc = dense.config, ConvertConfig(plan=plan)
    calib = np.random.default_rng(0).integers(0, cfg.vocab_size, (samples, seqlen), np.int32)
    mesh = calibration_mesh(samples)
    graphdef, state = nnx.split(dense)
    h = embed_step(graphdef, replicate(state, mesh), shard_batch(calib, mesh))
    rope = replicate(dense.rope(seqlen), mesh)
    layer = dense.layers[0]
    lg, ls = nnx.split(layer)
    ls = replicate(ls, mesh)
    h_mid, x, _ = attention_step(lg, ls, h, rope)
    w = [layer.mlp.gate[...], layer.mlp.up[...], layer.mlp.down[...]]
    xt = x.reshape(-1, x.shape[-1])
    markers, mu, _ = profile_layer(xt, *w, k_act=cc.k_act)
    carving = carve_layer(np.asarray(markers), np.asarray(mu), plan, k_act=cc.k_act,
                          router_neurons=cc.router_neurons)
    fg, fs = nnx.split(build_moe_ffn(cfg, cc, slices_for(layer, carving), dense.dtype))
    fs = replicate(fs, mesh)
    steps = {
        "attention (calibration pass)": lambda: attention_step(lg, ls, h, rope),
        "FFN profile (gate/up, ATopK)": lambda: profile_layer(xt, *w, k_act=cc.k_act),
        "converted FFN forward": lambda: ffn_residual_step(fg, fs, h_mid, x),
    }
    total = 0.0
    for name, fn in steps.items():
        t = _best_of(fn)
        total += t
        print(f"{name:>30}: {t:6.3f} s per layer, x{cfg.num_layers} = {t * cfg.num_layers:6.2f} s")
    print(f"{'floor of these steps':>30}: {total * cfg.num_layers:6.2f} s for {cfg.num_layers} layers")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--config", default="S1A1E8")
    p.add_argument("--calib-samples", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--kmeans-iters", type=int, default=None)
    p.add_argument("--data-path", default=None)
    p.add_argument("--floor", action="store_true",
                   help="also time the unavoidable per-layer steps in isolation")
    args = p.parse_args()

    from cmoe_jax.carving import MoEPlan
    from cmoe_jax.convert import convert
    from cmoe_jax.demo import local_wikitext

    data = args.data_path or (str(local_wikitext() / "valid.txt") if local_wikitext() else None)
    with tempfile.TemporaryDirectory() as tmp:
        m = convert(args.model, MoEPlan.parse(args.config), out=Path(tmp) / "out", calib="wikitext2",
                    data_path=data, calib_samples=args.calib_samples, seqlen=args.seqlen,
                    kmeans_iters=args.kmeans_iters, progress=False)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before the floor's own load
    if args.floor:
        layer_floor(args.model, MoEPlan.parse(args.config), args.calib_samples, args.seqlen)
    s = m["seconds"]
    for stage in ("profile", "cluster", "route_and_forward", "save"):
        print(f"{stage:>18}: {s[stage]:7.2f} s")
        if stage == "profile":
            print(f"{'of which attention':>18}: {s['attention']:7.2f} s (the calibration forward "
                  "pass's attention, no CMoE work)")
    print(f"{'model load':>18}: {s['load_model']:7.2f} s (excluded)")
    print(f"peak host memory: {peak_mib:.0f} MiB")
    print(f"{args.config} conversion of {args.model}: {s['convert']:.2f} s")


if __name__ == "__main__":
    main()

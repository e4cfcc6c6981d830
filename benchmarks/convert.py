"""Wall time of a full CMoE conversion of SmolLM2-135M, split by stage (model loading excluded).

    python benchmarks/convert.py [--config S1A1E8] [--calib-samples 8] [--seqlen 2048] [--repeats 3]
    python benchmarks/convert.py --shape llama2-7b --layers 2 [--backend pallas_gpu] [--dtype bf16]

One side only (there is no baseline in the same process), so no ratio: converts --repeats
times in one process and prints each stage's median, the first run's total (compilations
included: what a user's one conversion costs) and the median and min of all totals (later
runs reuse the compiled steps), the load average at start and end (`benchmarks/harness.py`;
a warning when it exceeds the core count), and the process's peak host memory (ru_maxrss),
which is what the README quotes. With `--floor`, also times the per-layer steps that any
conversion must run (the calibration pass's attention, the FFN profile, the converted FFN's
forward) on one layer in isolation, interleaved over --repeats after a warm-up (median and
min), to show where the time goes and what 30 layers of them cost.

With `--shape llama2-7b --layers N`, no checkpoint is read: each of N decoder layers of that
shape gets random weights just before it is converted (and is freed after), the calibration
residual stream starts as random activations, and every layer runs the pipeline's own steps
(attention pass, FFN profile, carving, router fit, converted FFN forward with `--backend`).
Prints each layer's stage times and the peak device memory (`memory_stats`, else the host's
peak RSS), the median and min over the layers after the first (which also compiles), the
load average at start and end, and the projection to all the shape's layers (from the
median): the paper's "minutes for a 7B model" measured with one command on an accelerator host.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import interleaved_times, load_average, print_load  # noqa: E402


def layer_floor(model: str, plan, samples: int, seqlen: int, repeats: int) -> None:
    """Seconds per layer of the steps every conversion runs, on layer 0 of `model` (random
    token ids: the cost does not depend on them), and that times the number of layers."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from cmoe_jax.methods.cmoe import ConvertConfig, carve_layer, moe_spec, slices_for
    from cmoe_jax.calibration_pass.markers import profile_layer
    from cmoe_jax.models.ffn import filled_ffn
    from cmoe_jax.loading import load_model
    from cmoe_jax.calibration_pass.layer_pass import (attention_step, calibration_mesh, embed_step,
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
    markers, mu, _ = profile_layer(xt, *w, k_act=cc.k_act, activation="silu")
    carving = carve_layer(np.asarray(markers), np.asarray(mu), plan, k_act=cc.k_act,
                          router_neurons=cc.router_neurons)
    fg, fs = nnx.split(filled_ffn(cfg, moe_spec(cfg, cc, cc.plan), slices_for(layer, carving), dense.dtype))
    fs = replicate(fs, mesh)
    steps = {
        "attention (calibration pass)": lambda: attention_step(lg, ls, h, rope),
        "FFN profile (gate/up, ATopK)": lambda: profile_layer(xt, *w, k_act=cc.k_act, activation="silu"),
        "converted FFN forward": lambda: ffn_residual_step(fg, fs, h_mid, x),
    }
    blocking = [lambda fn=fn: jax.block_until_ready(fn()) for fn in steps.values()]
    times = interleaved_times(blocking, repeats)  # the warm-up compiles each step
    n = cfg.num_layers
    for name, ts in zip(steps, times):
        med = statistics.median(ts)
        print(f"{name:>30}: {med:6.3f} s per layer (median, min {min(ts):.3f}), x{n} = {med * n:6.2f} s")
    print(f"{'floor of these steps':>30}: {sum(map(statistics.median, times)) * n:6.2f} s for {n} layers")


SHAPES = {  # Hugging Face config values (meta-llama/Llama-2-7b-hf)
    "llama2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096,
                      intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32,
                      head_dim=128, activation="silu", rms_norm_eps=1e-5, max_position_embeddings=4096),
}


def peak_memory() -> str:
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return f"peak device memory {stats['peak_bytes_in_use'] / 2**30:.2f} GiB"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return f"peak host RSS {rss:.2f} GiB (no device memory stats)"


def random_layers(args, load_start: float) -> None:
    """Convert `args.layers` random layers of shape `args.shape`, one at a time."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from cmoe_jax.methods.cmoe import (ConvertConfig, MoEPlan, carve_one_layer, fit_layer, moe_spec,
                                       slices_for)
    from cmoe_jax.models.ffn import filled_ffn
    from cmoe_jax.models.config import ModelConfig
    from cmoe_jax.models.decoder import DecoderLayer
    from cmoe_jax.models.layers import rope_tables
    from cmoe_jax.calibration_pass.layer_pass import (attention_step, calibration_mesh,
                                                      ffn_residual_step, replicate, shard_batch)

    cfg = ModelConfig(**SHAPES[args.shape])
    dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[args.dtype]
    cc = ConvertConfig(plan=MoEPlan.parse(args.config), kmeans_iters=args.kmeans_iters)
    mesh = calibration_mesh(args.calib_samples)
    shape = (args.calib_samples, args.seqlen, cfg.hidden_size)
    h = shard_batch(jax.random.normal(jax.random.PRNGKey(0), shape, dtype), mesh)
    rope = replicate(rope_tables(cfg, jnp.arange(args.seqlen)), mesh)
    print(f"# {args.shape} {args.config} {args.dtype}, {args.calib_samples}x{args.seqlen} "
          f"calibration tokens, backend {args.backend}, {jax.device_count()} {jax.default_backend()} "
          f"device(s); random weights, one layer at a time", flush=True)
    times = []
    for i in range(args.layers):
        t0 = time.perf_counter()
        layer = DecoderLayer(cfg, 0, dtype=dtype, rngs=nnx.Rngs(i))
        lg, ls = nnx.split(layer)
        jax.block_until_ready(ls)
        t1 = time.perf_counter()
        h_mid, x, _ = attention_step(lg, replicate(ls, mesh), h, rope)
        jax.block_until_ready(x)
        t2 = time.perf_counter()
        carving, _, secs = carve_one_layer(layer, x, cc, cc.plan)
        ffn = filled_ffn(cfg, moe_spec(cfg, cc, cc.plan), slices_for(layer, carving), dtype)
        ffn.backend = args.backend
        fit_layer(ffn, x, cc, mesh)
        fg, fs = nnx.split(ffn)
        h, _ = jax.block_until_ready(ffn_residual_step(fg, replicate(fs, mesh), h_mid, x))
        t3 = time.perf_counter()
        del layer, ls, h_mid, x, ffn, fs
        times.append(t3 - t1)
        print(f"layer {i}: {t3 - t1:7.2f} s (attention {t2 - t1:.2f}, profile {secs['profile']:.2f}, "
              f"cluster {secs['cluster']:.2f}, fits + forward "
              f"{t3 - t2 - secs['profile'] - secs['cluster']:.2f}; random init {t1 - t0:.2f} "
              f"excluded), {peak_memory()}", flush=True)
    steady = times[1:] or times  # layer 0 also compiles every step
    per_layer = statistics.median(steady)
    print(f"{args.layers} layer(s): {sum(times):.2f} s; per layer{' after the first' if times[1:] else ''}: "
          f"median {per_layer:.2f} s, min {min(steady):.2f} s; {cfg.num_layers} layers at the median: "
          f"{per_layer * cfg.num_layers / 60:.1f} min")
    print_load(load_start, len(steady), ratio=False)


def main() -> None:
    from cmoe_jax.moe.gmm import BACKENDS

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="convert random layers of this shape instead of --model")
    p.add_argument("--layers", type=int, default=2, help="with --shape: layers to convert")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="with --shape")
    p.add_argument("--backend", choices=("auto",) + BACKENDS, default="auto",
                   help="with --shape: grouped-matmul backend of the converted FFN forward")
    p.add_argument("--config", default="S1A1E8")
    p.add_argument("--calib-samples", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--kmeans-iters", type=int, default=None)
    p.add_argument("--data-path", default=None)
    p.add_argument("--floor", action="store_true",
                   help="also time the unavoidable per-layer steps in isolation")
    p.add_argument("--repeats", type=int, default=3,
                   help="conversions (and --floor repeats) whose median and min are printed")
    args = p.parse_args()
    load_start = load_average()
    if args.shape:
        return random_layers(args, load_start)

    from cmoe_jax.methods.cmoe import MoEPlan
    from cmoe_jax.convert import Calibration, ConvertConfig, ConvertSettings, convert
    from cmoe_jax.demo import local_wikitext

    data = args.data_path or (str(local_wikitext() / "valid.txt") if local_wikitext() else None)
    runs = []
    for _ in range(max(1, args.repeats)):
        with tempfile.TemporaryDirectory() as tmp:
            job = ConvertSettings(ConvertConfig(plan=MoEPlan.parse(args.config), kmeans_iters=args.kmeans_iters),
                             Calibration(data_path=data, samples=args.calib_samples, seqlen=args.seqlen))
            runs.append(convert(args.model, job, out=Path(tmp) / "out", progress=False)["seconds"])
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before the floor's own load
    if args.floor:
        layer_floor(args.model, MoEPlan.parse(args.config), args.calib_samples, args.seqlen, args.repeats)
    med = {stage: statistics.median(r[stage] for r in runs) for stage in runs[0]}
    print(f"medians of {len(runs)} conversion(s):")
    for stage in ("profile", "cluster", "route_and_forward", "save"):
        print(f"{stage:>18}: {med[stage]:7.2f} s")
        if stage == "profile":
            print(f"{'of which attention':>18}: {med['attention']:7.2f} s (the calibration forward "
                  "pass's attention, no CMoE work)")
    print(f"{'model load':>18}: {med['load_model']:7.2f} s (excluded)")
    print(f"peak host memory: {peak_mib:.0f} MiB")
    totals = [r["convert"] for r in runs]
    print_load(load_start, len(runs), ratio=False)
    print(f"{args.config} conversion of {args.model}: first {totals[0]:.2f} s (compilations included), "
          f"median {statistics.median(totals):.2f} s, min {min(totals):.2f} s")


if __name__ == "__main__":
    main()

"""Where one MoE layer's time goes, and which Pallas tiles its grouped matmuls want on a GPU.

    python benchmarks/moe_breakdown.py --shape 4096x11008 --tokens 4096 --config S1A1E8 S3A3E8

For each configuration (the same layer as `benchmarks/moe_grid.py`, bf16 by default) it
times, each as its own jitted call: the dense FFN; the whole layer on its dispatch paths;
its parts (the router and its scores with and without upcasting the operands, the shared
MLP, the sort's plan by counting and by argsort, the argsort alone, the row gather, gate and up as two
grouped matmuls and the activation, the down projection, the unsort and combine); then, on
a GPU, the Pallas grouped matmul of the gate and of the down projection at each `--tiles`
(tm x tk x tn) and `--launches` (warps x stages; `--tiles` with no value: no sweep). A time
is the mean of `--calls` calls queued without waiting (launch overhead hidden as in a
model), the median of `--reps` interleaved rounds. Prints a table; `--out` gets the JSON.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from datetime import date
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import interleaved_times, load_average, machine_line, module_call  # noqa: E402
from benchmarks.moe_grid import DTYPES, build, parse_config, swiglu, swiglu_f32_acc  # noqa: E402

TILES = ("128x64x128", "128x64x256", "64x64x128", "128x128x128", "64x128x128", "128x32x256",
         "256x64x128", "64x64x256")
LAUNCHES = ("default", "4x3", "8x3", "8x4", "4x4")


def queued(fn, args, calls: int):
    """A zero-argument side running `fn(*args)` `calls` times, queued before one wait."""
    def side():
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
    return side


def timed(sides: dict, calls: int, reps: int) -> dict:
    """name -> milliseconds per call (median over `reps` interleaved rounds); sides that fail
    to compile or run are reported as the error's first line."""
    out, live = {}, {}
    for name, (fn, args) in sides.items():
        try:
            jax.block_until_ready(fn(*args))
            live[name] = queued(fn, args, calls)
        except Exception as e:  # noqa: BLE001 - a tile that does not fit is a result too
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    times = interleaved_times(list(live.values()), reps, warmup=1)
    out.update({name: statistics.median(ts) / calls * 1e3 for name, ts in zip(live, times)})
    return out


def triple(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split("x"))


def parts(layer, x, gmm):
    """The layer's steps as separate jitted calls over precomputed inputs (weights passed
    as arguments: closed over, XLA would constant-fold their padding at compile time)."""
    from cmoe_jax.moe.activations import glu_activation
    from cmoe_jax.moe.dispatch import combine, counting_plan, plan, sorting_plan
    from cmoe_jax.moe.routers.cmoe import cmoe_scores

    act = glu_activation(layer.activation)
    method = lambda name: module_call(layer, lambda m, x: getattr(m, name)(x))  # noqa: E731
    w = tuple(p[...] for p in (layer.expert_gate, layer.expert_up, layer.expert_down))
    route, leaves = method("route")
    ids, gates = route(leaves, x)
    k, e = ids.shape[1], w[0].shape[0]
    d = jax.jit(plan, static_argnums=1)(ids, e)
    src = d.order // k
    rows = jax.jit(lambda x, s: x[s])(x, src)
    two = jax.jit(lambda r, s, wg, wu: act(gmm(r, wg, s)) * gmm(r, wu, s))
    h = two(rows, d.group_sizes, w[0], w[1])
    down = jax.jit(lambda h, s, wd: gmm(h, wd, s))
    ys = down(h, d.group_sizes, w[2])
    router = (layer.router_gate[...], layer.router_up[...])
    scores = jax.jit(lambda x, g, u, f: cmoe_scores(f(x), f(g), f(u), e, activation=layer.activation),
                     static_argnums=3)
    argsort = lambda i: jax.lax.sort_key_val(i.reshape(-1), jnp.arange(i.size))[1]  # noqa: E731
    return {
        "router": (route, (leaves, x)),
        "router scores": (scores, (x, *router, lambda a: a)),
        "router scores, upcast operands": (scores, (x, *router, lambda a: a.astype(jnp.float32))),
        "shared MLP": (method("shared")[0], (leaves, x)),
        "plan by counting": (jax.jit(counting_plan, static_argnums=1), (ids.reshape(-1), e)),
        "plan by argsort": (jax.jit(sorting_plan, static_argnums=1), (ids.reshape(-1), e)),
        "argsort alone": (jax.jit(argsort), (ids,)),
        "gather rows": (jax.jit(lambda x, s: x[s]), (x, src)),
        "gate + up + act (2 gmm)": (two, (rows, d.group_sizes, w[0], w[1])),
        "down (gmm)": (down, (h, d.group_sizes, w[2])),
        "unsort + combine": (jax.jit(lambda y, i, g: combine(y, g, i)), (ys, d.inverse, gates)),
    }, (rows, d.group_sizes, h, *w)


def tile_sweep(inputs, tiles_list, launches, calls, reps, interpret=False) -> dict:
    """The Pallas GPU grouped matmul of the gate projection and of the down projection at
    each tile and launch."""
    from cmoe_jax.moe.gmm import pallas_gpu

    rows, sizes, h, wg, _, wd = inputs
    sides = {}
    for tiles in map(triple, tiles_list):
        for launch in launches:
            lp = None if launch == "default" else triple(launch)
            mm = jax.jit(functools.partial(pallas_gpu.gmm_impl, tiles=tiles, launch=lp, interpret=interpret))
            tag = f"{'x'.join(map(str, tiles))} {launch}"
            sides[f"gate {tag}"] = (lambda a, w, g, f=mm: f(a, w, g), (rows, wg, sizes))
            sides[f"down {tag}"] = (lambda a, w, g, f=mm: f(a, w, g), (h, wd, sizes))
    return timed(sides, calls, reps)


def run_config(args, config: str) -> dict:
    from cmoe_jax.moe.gmm import get_gmm

    dtype = DTYPES[args.dtype]
    d = int(args.shape.split("x")[0])
    dense, layer_of = build(args.shape, config, dtype, args.router_neurons, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (args.tokens, d), jnp.float32).astype(dtype)
    layer = layer_of("sort")
    steps, inputs = parts(layer, x, get_gmm(args.backend))

    def whole(path):
        f, leaves = module_call(layer_of(path))
        return f, (leaves, x)

    sides = {"dense FFN": (jax.jit(swiglu), (x, *dense)),
             "dense FFN (f32 acc)": (jax.jit(swiglu_f32_acc), (x, *dense))}
    sides.update({f"layer {p}": whole(p) for p in args.paths})
    sides.update(steps)
    times = timed(sides, args.calls, args.reps)
    sweep = (tile_sweep(inputs, args.tiles, args.launches, args.calls, args.reps, args.interpret)
             if args.tiles else {})
    best = {kind: min((v, k) for k, v in sweep.items() if k.startswith(kind) and isinstance(v, float))
            for kind in ("gate", "down") if any(k.startswith(kind) and isinstance(v, float) for k, v in sweep.items())}
    return dict(config=config, times_ms=times, tiles_ms=sweep,
                best={k: dict(ms=v[0], side=v[1]) for k, v in best.items()})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="4096x11008")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--config", nargs="+", default=["S1A1E8", "S3A3E8"])
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--backend", default="auto", help="grouped-matmul backend of the parts")
    p.add_argument("--paths", nargs="+", default=["auto", "sort", "dense"])
    p.add_argument("--tiles", nargs="*", default=list(TILES), help="tm x tk x tn of the sweep (none: no sweep)")
    p.add_argument("--launches", nargs="+", default=list(LAUNCHES), help="warps x stages, or 'default'")
    p.add_argument("--router-neurons", type=int, default=16)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--interpret", action="store_true", help="Pallas kernels interpreted (a CPU check of this script)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    for c in args.config:
        parse_config(c)
    result = dict(machine=machine_line(), date=date.today().isoformat(), argv=sys.argv[1:],
                  load_at_start=load_average(), configs=[])
    print(f"# {result['machine']}; load average {result['load_at_start']:.2f}", flush=True)
    for config in args.config:
        r = run_config(args, config)
        result["configs"].append(r)
        print(f"## {args.shape}, {args.tokens} tokens, {config}, {args.dtype}", flush=True)
        for name, ms in {**r["times_ms"], **r["tiles_ms"]}.items():
            print(f"{name:36s} {ms:.4f} ms" if isinstance(ms, float) else f"{name:36s} {ms}", flush=True)
        print(f"best: {r['best']}", flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

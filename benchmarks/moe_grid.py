"""The MoE FFN against the dense FFN it was cut from, over a grid of shapes, token counts,
configurations and dtypes: each cell the ratio dense time / MoE time, both measured
interleaved in one run, with its ideal ratio, the load average and the path the layer took.

    python benchmarks/moe_grid.py                                   # the full grid (CPU: long)
    python benchmarks/moe_grid.py --shape 576x1536 --tokens 16 4096 --paths auto sort dense
    python benchmarks/moe_grid.py --out grid.json --time-budget 300 # stop starting cells at 300 s

A cell: the dense SwiGLU FFN `d x d_h` (in bf16 the faster of plain and float32-accumulating
dots) and an `MoEFFN` made of the same neurons for the
configuration SxAyEz (x shared experts as the shared MLP, z - x routed, y active a token,
the CMoE router with `--router-neurons` representative neurons per expert, whose cost
counts; its neurons are each expert's first ones, as CMoE's representative neurons are the
expert's own, so the loads are as balanced as a converted model's), random weights and inputs.
`--paths` names the layer's dispatch paths timed beside the dense FFN: "auto" (what the
layer picks; the ratio column), "sort", "dense", "gather" (at most 64 pairs), each
optionally "@backend" for the grouped matmul (e.g. "sort@ragged_dot"). The ideal ratio is
z / (x + y). `--cache` sets what each timed call finds in the cache
(`benchmarks/harness.cache_state`): "cold" (the weights evicted, as each layer of a model's
step finds them), "warm" (the side run once more first) or "mixed" (the default: whatever
the side before it left, so at small shapes a cell's ratios depend on how many paths it
times). Rows are printed as they finish; `--out` gets the JSON (rewritten after every cell,
so a cut run keeps what it measured), a markdown table and a PNG plot beside it.
Ratios are withheld (`busy`) when the load average at the run's start exceeds the cores;
each row's load column is the load at the cell's start (this run's own threads included).
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (CACHE_STATES, allocator_env, cache_state, interleaved_times,  # noqa: E402
                                load_average, machine_busy, machine_line, module_call)

SHAPES = ("576x1536", "640x2048", "4096x11008")
TOKENS = (1, 16, 128, 4096)
CONFIGS = ("S1A1E8", "S2A2E8", "S3A3E8", "S1A3E16")
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
GATHER_MAX_PAIRS = 64


def parse_config(name: str) -> tuple[int, int, int]:
    found = re.fullmatch(r"S(\d+)A(\d+)E(\d+)", name)
    if not found:
        raise SystemExit(f"error: bad configuration {name!r}: expected SxAyEz, e.g. S1A1E8")
    return tuple(int(g) for g in found.groups())


def build(shape: str, config: str, dtype, router_neurons: int, key):
    """(dense weights, {path: MoEFFN}) over the same neurons."""
    from flax import nnx

    from cmoe_jax.moe import MoEFFN

    d, dh = (int(v) for v in shape.split("x"))
    s, a, z = parse_config(config)
    if dh % z:
        raise SystemExit(f"error: d_h={dh} does not split into {z} experts")
    m = dh // z
    k = jax.random.split(key, 5)
    w = lambda kk, *sh: (jax.random.normal(kk, sh, jnp.float32) * 0.02).astype(dtype)  # noqa: E731
    dense = (w(k[0], d, dh), w(k[1], d, dh), w(k[2], dh, d))
    r = min(router_neurons, m)

    def layer(path: str):
        dispatch, _, backend = path.partition("@")
        moe = MoEFFN(d_model=d, expert_width=m, num_experts=z - s, top_k=a, shared_width=s * m, router="cmoe", router_neurons=r,
                     dtype=dtype, param_dtype=dtype, backend=backend or "auto", expert_axis=None,
                     dispatch=dispatch, activation="silu", rngs=nnx.Rngs(0))
        split = lambda wt, axis: jnp.moveaxis(wt.reshape(*wt.shape[:axis], z, m, *wt.shape[axis + 1:]), axis, 0)  # noqa: E731
        gate, up, down = split(dense[0], 1), split(dense[1], 1), split(dense[2], 0)
        if s:  # S0AyEz: no shared MLP
            moe.shared_gate[...] = gate[:s].transpose(1, 0, 2).reshape(d, s * m)
            moe.shared_up[...] = up[:s].transpose(1, 0, 2).reshape(d, s * m)
            moe.shared_down[...] = down[:s].reshape(s * m, d)
        moe.expert_gate[...], moe.expert_up[...], moe.expert_down[...] = gate[s:], up[s:], down[s:]
        # the router's neurons are each expert's first r neurons, as CMoE's representative
        # neurons are its own: the loads come out as balanced as a converted model's
        moe.router_gate[...] = gate[s:, :, :r].transpose(1, 0, 2).reshape(d, (z - s) * r)
        moe.router_up[...] = up[s:, :, :r].transpose(1, 0, 2).reshape(d, (z - s) * r)
        return moe
    return dense, layer


def swiglu(x, wg, wu, wd):
    """The dense FFN as the models compute it (`cmoe_jax.models.layers.SwiGLU`)."""
    return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def swiglu_f32_acc(x, wg, wu, wd):
    """The same with float32 accumulation: in bf16 on CPU XLA's plain bf16 dot is slower
    than one accumulating in float32, which the MoE paths use; the ratio is against the
    faster of the two, so a bf16 ratio never credits the MoE with a slow baseline."""
    mm = lambda a, w: jnp.dot(a, w, preferred_element_type=jnp.float32).astype(a.dtype)  # noqa: E731
    return mm(jax.nn.silu(mm(x, wg)) * mm(x, wu), wd)


def auto_path(tokens: int, config: str, dtype, shape: str) -> str:
    from cmoe_jax.moe.modes import PairCall, dispatch_mode
    s, a, z = parse_config(config)
    d, d_h = map(int, shape.split("x"))
    return dispatch_mode(PairCall(tokens * a, z - s, a, dtype, d * (d_h // z)))


def run_cell(shape, tokens, config, dtype_name, paths, router_neurons, reps, load_at_start,
             cache: str = "mixed") -> dict:
    load = load_average()  # includes this run's own threads after the first cell
    dtype = DTYPES[dtype_name]
    s, a, z = parse_config(config)
    dense, layer = build(shape, config, dtype, router_neurons, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (tokens, int(shape.split("x")[0])), jnp.float32).astype(dtype)
    paths = [p for p in paths if not (p.startswith("gather") and tokens * a > GATHER_MAX_PAIRS)]
    def pure(path):  # once: nnx.jit would walk the module's graph on every call
        return module_call(layer(path), lambda m, x: m(x, return_load=True))

    baselines = [swiglu] + ([swiglu_f32_acc] if dtype != jnp.float32 else [])
    sides = ([(jax.jit(f), (x, *dense)) for f in baselines]
             + [(f, (st, x)) for f, st in map(pure, paths)])
    calls = [lambda f=f, xs=xs: jax.block_until_ready(f(*xs)) for f, xs in sides]
    t0 = time.perf_counter()
    for call in calls:
        call()  # compile
    once = (time.perf_counter() - t0) / len(calls)
    t0 = time.perf_counter()
    for call in calls:
        call()
    per_round = time.perf_counter() - t0
    n = max(reps, min(50, int(2.0 / max(per_round, 1e-6))))
    before = cache_state(cache)
    times = [statistics.median(ts) for ts in interleaved_times(calls, n, warmup=0, before=before)]
    first_moe = sides[len(baselines)]
    counts = jax.device_get(first_moe[0](*first_moe[1])[1])
    t_dense, t_paths = min(times[:len(baselines)]), dict(zip(paths, times[len(baselines):]))
    busy = machine_busy(load_at_start)
    moe_path = "auto" if "auto" in t_paths else paths[0]
    return dict(shape=shape, tokens=tokens, config=config, dtype=dtype_name,
                dense_s=t_dense, dense_plain_s=times[0], moe_s=t_paths, auto_path=auto_path(tokens, config, dtype, shape),
                ratio=None if busy else t_dense / t_paths[moe_path],
                best=min(t_paths, key=t_paths.get), ideal=z / (s + a), cache=cache, load=load, busy=busy,
                max_over_mean_load=float(counts.max() / max(counts.mean(), 1e-9)), reps=n,
                compile_s=once)


def row(c: dict) -> str:
    ms = lambda t: f"{t * 1e3:.3g}"  # noqa: E731
    ratio = "busy" if c["ratio"] is None else f"{c['ratio']:.2f}x"
    others = ", ".join(f"{p} {c['dense_s'] / t:.2f}x" for p, t in c["moe_s"].items() if p != "auto")
    flag = " **" if c["ratio"] is not None and c["ratio"] < 1.0 and c["ideal"] >= 4 / 3 else ""
    return (f"| {c['shape']} | {c['tokens']} | {c['config']} | {c['dtype']} | {ms(c['dense_s'])} | "
            f"{ms(c['moe_s'].get('auto', min(c['moe_s'].values())))} ({c['auto_path']}) | "
            f"{ratio}{flag} | {c['ideal']:.2f}x | {others} | {c['load']:.2f} |")


HEADER = ("| shape | tokens | config | dtype | dense ms | MoE ms (path) | dense/MoE | ideal | "
          "other paths (dense/MoE) | load |\n|---|---|---|---|---|---|---|---|---|---|")


def plot(cells: list[dict], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({c["shape"] for c in cells}, key=lambda s: int(s.split("x")[0]))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for (config, dt), group in itertools.groupby(
                sorted((c for c in cells if c["shape"] == shape and c["ratio"]),
                       key=lambda c: (c["config"], c["dtype"], c["tokens"])),
                key=lambda c: (c["config"], c["dtype"])):
            group = list(group)
            ax.plot([c["tokens"] for c in group], [c["ratio"] for c in group], "o-" if dt == "fp32" else "s--",
                    label=f"{config} {dt}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xscale="log", title=shape, xlabel="tokens", ylabel="dense time / MoE time")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", nargs="+", default=list(SHAPES), help="d_model x d_h, e.g. 576x1536")
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    p.add_argument("--config", nargs="+", default=list(CONFIGS))
    p.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--paths", nargs="+", default=["auto", "sort", "dense"],
                   help="dispatch paths timed, 'auto' first for the ratio; 'path@backend' picks the gmm")
    p.add_argument("--router-neurons", type=int, default=16)
    p.add_argument("--reps", type=int, default=3, help="at least this many interleaved rounds")
    p.add_argument("--time-budget", type=float, default=0, help="seconds: start no cell after (0: none)")
    p.add_argument("--cache", choices=CACHE_STATES, default="mixed",
                   help="the cache state each timed call starts from (benchmarks/harness.cache_state): "
                        "warm (weights in cache), cold (from memory, as in a model's step), mixed (as left)")
    p.add_argument("--out", type=Path, help="JSON results (a .md table and a .png plot beside it)")
    args = p.parse_args(argv)
    for c in args.config:
        parse_config(c)
    load_at_start = load_average()
    env = allocator_env()
    print(f"# {machine_line()}; load average {load_at_start:.2f} at start; cache {args.cache}"
          + "".join(f"; {k}={v}" for k, v in env.items()), flush=True)
    meta = dict(machine=machine_line(), date=date.today().isoformat(), argv=sys.argv[1:],
                load_at_start=load_at_start, env=env, cache=args.cache)
    cells, start = [], time.perf_counter()
    print(HEADER, flush=True)
    for dt, shape, tokens, config in itertools.product(args.dtype, args.shape, args.tokens, args.config):
        if args.time_budget and time.perf_counter() - start > args.time_budget:
            print(f"# time budget {args.time_budget:.0f} s spent: cells left out", flush=True)
            break
        cells.append(run_cell(shape, tokens, config, dt, args.paths, args.router_neurons, args.reps,
                              load_at_start, args.cache))
        print(row(cells[-1]), flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(dict(meta, cells=cells), indent=1))
    if args.out and cells:
        args.out.with_suffix(".md").write_text(f"{meta['machine']}, {meta['date']}\n\n{HEADER}\n"
                                               + "\n".join(map(row, cells)) + "\n")
        plot(cells, args.out.with_suffix(".png"))
    print(f"# load average {load_average():.2f} at end, {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

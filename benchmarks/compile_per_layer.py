"""Compile time of the forward when the layers differ in shape (`convert --active F`).

    python benchmarks/compile_per_layer.py [--layers 30] [--seqlen 128] [--vocab 1024] [--repeats 1]

Models at SmolLM2-135M's dimensions (hidden 576, FFN 1536, 9 heads, 3 KV heads; a small
vocabulary, which the compile time hardly depends on) with random weights, built five ways:

- dense: every layer the dense SwiGLU, stored as a `LayerStack` (one layer compiled, scanned);
- dense-unrolled: the same layers kept as an `nnx.List` (each layer traced and compiled);
- S3A3E8: every layer the same carved shape (a `LayerStack` again);
- budget: what a budget gives, the 8 candidate shapes of `--active` (S0A1E8 ... S3A4E8 and
  dense) spread over the layers, so shapes repeat (an `nnx.List`);
- budget-grouped: the budget model run with each run of consecutive same-shape layers
  stacked and scanned (`grouped_forward`, a sketch here, not the package's forward);
- distinct: no two layers alike, shared, active and expert counts varied (an `nnx.List`).

For each: the seconds to trace and lower `jax.jit(forward)` on a [1, seqlen] batch, the
seconds of `.compile()`, their sum, and the sum's ratio to the uniform S3A3E8 model's.
Compilation caches are cleared before each; --repeats > 1 prints the median and the min.
One process, one after another (compiles are single-threaded mostly, so load from other
processes inflates them: the load average at start and end is printed).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import load_average, machine_line, print_load  # noqa: E402

SHAPES = ("dense", "dense-unrolled", "S3A3E8", "budget", "budget-grouped", "distinct")


def layer_plans(kind: str, n: int):
    """Each layer's shape (None: dense) of model `kind` (`SHAPES`)."""
    from cmoe_jax.methods.cmoe import MoEPlan
    from cmoe_jax.methods.cmoe.job import Budget

    if kind in ("dense", "dense-unrolled"):
        return [None] * n
    if kind == "S3A3E8":
        return [MoEPlan(3, 3, 8)] * n
    if kind.startswith("budget"):  # all 8 candidates, in runs of 1, 2, 3 layers
        candidates, plans, i = Budget(0.375).candidates(), [], 0
        while len(plans) < n:
            plans += [candidates[(3 * i) % len(candidates)]] * (1 + i % 3)
            i += 1
        return plans[:n]
    # distinct: shared 0-2, active 1-3 of 8, 4, 16, 6 or 12 experts (33 shapes)
    plans = [MoEPlan(s, a, e) for e in (8, 4, 16, 6, 12) for s in range(3) for a in range(1, 4) if s + a < e]
    if n > len(plans):
        raise SystemExit(f"--layers {n}: at most {len(plans)} distinct shapes here")
    return plans[:n]


def build(kind: str, args):
    import jax.numpy as jnp
    from flax import nnx

    from cmoe_jax.methods.cmoe import ConvertConfig, moe_spec
    from cmoe_jax.models import Decoder, ModelConfig

    cfg = ModelConfig(model_type="llama", vocab_size=args.vocab, hidden_size=576, intermediate_size=1536,
                      num_layers=args.layers, num_heads=9, num_kv_heads=3, head_dim=64, activation="silu",
                      max_position_embeddings=2048, tie_word_embeddings=True)
    cc = ConvertConfig(plan=None)
    plans = layer_plans(kind, args.layers)
    if any(p is not None for p in plans):
        cfg = cfg.with_moe_layers([moe_spec(cfg, cc, p) for p in plans])
    model = Decoder(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0), stack=kind != "dense-unrolled")
    distinct = len({s for s in (cfg.moe_layers or [None])})
    return (Grouped(model) if kind.endswith("grouped") else model), distinct


class Grouped:
    """A model's layers in runs of consecutive layers of one structure, each run of two or
    more as a `LayerStack` (scanned), the rest as single layers: `forward(groups, outer,
    tokens)` runs them in order between the model's embedding and LM head (`outer`)."""

    def __init__(self, model):
        import jax
        from flax import nnx

        from cmoe_jax.models.stack import LayerStack, stackable

        h = jax.ShapeDtypeStruct((1, 2, model.config.hidden_size), model.dtype)
        runs = []
        for layer in model.layers:
            if runs and stackable([runs[-1][-1], layer], h, model.rope(2)):
                runs[-1].append(layer)
            else:
                runs.append([layer])
        self.groups = nnx.List([LayerStack.from_layers(r) if len(r) > 1 else r[0] for r in runs])
        self.outer = nnx.merge(*nnx.split(model))
        self.outer.layers = nnx.List([])

    @staticmethod
    def forward(groups, outer, tokens):
        from cmoe_jax.models.stack import LayerStack

        rope, h = outer.rope(tokens.shape[-1]), outer.embed_tokens(tokens)
        for group in groups:
            h = group.scan(h, rope)[0] if isinstance(group, LayerStack) else group(h, rope).h
        return outer.unembed(h)


def compile_seconds(model, seqlen: int) -> tuple[float, float]:
    """(trace and lower, compile) seconds of the jitted forward, caches cleared first."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    tokens = jnp.zeros((1, seqlen), jnp.int32)
    if isinstance(model, Grouped):
        (gg, gs), (og, os_) = nnx.split(model.groups), nnx.split(model.outer)
        forward = lambda s, t: Grouped.forward(nnx.merge(gg, s[0]), nnx.merge(og, s[1]), t)
        state = (gs, os_)
    else:
        graphdef, state = nnx.split(model)
        forward = lambda s, t: nnx.merge(graphdef, s)(t)
    jax.clear_caches()
    t0 = time.perf_counter()
    lowered = jax.jit(forward).lower(state, tokens)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    from cmoe_jax.models.stack import LayerStack

    print(machine_line())
    load_start = load_average()
    rows = {}
    for kind in SHAPES:
        model, distinct = build(kind, args)
        times = [compile_seconds(model, args.seqlen) for _ in range(args.repeats)]
        storage = ("runs" if isinstance(model, Grouped) else
                   "LayerStack" if isinstance(model.layers, LayerStack) else "nnx.List")
        rows[kind] = (storage, distinct, times)
        del model
    base = statistics.median(sum(t) for t in rows["S3A3E8"][2])
    print(f"{'model':15s} {'layers':10s} {'FFN shapes':>10s} {'lower s':>8s} {'compile s':>9s} "
          f"{'total s':>8s} {'min s':>7s} {'x S3A3E8':>8s}")
    for kind, (storage, distinct, times) in rows.items():
        lower, comp = (statistics.median(t[i] for t in times) for i in (0, 1))
        total = [sum(t) for t in times]
        print(f"{kind:15s} {storage:10s} {distinct:10d} {lower:8.2f} {comp:9.2f} "
              f"{statistics.median(total):8.2f} {min(total):7.2f} {statistics.median(total) / base:8.2f}")
    print_load(load_start, args.repeats, ratio=False)


if __name__ == "__main__":
    main()

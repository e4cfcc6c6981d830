"""One KV-cache decode step of each model, timed, and what its compiled program copies.

    python benchmarks/decode_step.py [--model smollm2 out/u025 ...] [--batch 1 16]
        [--length 256] [--repeats 40] [--unrolled]

Each model's jitted decode step (`cmoe_jax.generate.engine`'s, one token a row over a cache
of `--length` slots) is compiled and run `--repeats` times, the models interleaved after a
warm-up. For each model and batch it prints the median step time and the copies and
transposes in the compiled step whose shape is a layer's whole cache or the embedding table:
the arrays a step should read where they lie. `--unrolled` also times each model whose layers
stack run unrolled, with a cache of its own for each layer, as a model of differing layers runs. To compare two versions of the code, run it in
a checkout of each, alternately, on a quiet machine (the load average is printed).
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import interleaved_times, load_average, machine_line, print_load  # noqa: E402


def compiled_step(model, batch: int, length: int, slot: int = 10):
    """(a zero-argument callable running one decode step, blocking; the compiled step's HLO
    text): one token a row written at `slot` of a cache of `length` slots."""
    import jax
    import jax.numpy as jnp

    from cmoe_jax.generate import engine
    from cmoe_jax.sharding import make_mesh, placed_split

    graphdef, state = placed_split(model, make_mesh())
    leaves, treedef = jax.tree.flatten(state)
    ones = jnp.ones((batch, 1), jnp.int32)
    step = engine.StepInput(ones, ones.astype(bool), ones * slot, jnp.int32(slot))
    knobs = engine.Knobs(jnp.float32(1), jnp.int32(0), jnp.float32(1))
    key = jax.random.PRNGKey(0)
    cache = model.empty_cache(batch, length).mark(ones.astype(bool), slot)
    compiled = engine._jitted_step(graphdef, treedef).lower(leaves, cache, step, key, knobs,
                                                            greedy=True).compile()
    held = [cache]

    def run():  # the step donates its cache: the next one runs on this one's
        token, new = compiled(leaves, held.pop(), step, key, knobs)
        jax.block_until_ready(token)
        held.append(new)
    return run, compiled.as_text()


def whole_copies(model, hlo: str, batch: int, length: int) -> list[str]:
    """The copies and transposes in `hlo` of a layer's whole cache ([B, K, S, H] or a layer's
    own [B K, S, H], in either order of the last two) or of the embedding table (either
    orientation)."""
    cfg = model.config
    kv, h = cfg.num_kv_heads, cfg.head_dim
    cache = {(batch, kv, length, h), (batch, kv, h, length), (batch * kv, length, h), (batch * kv, h, length)}
    table = {(cfg.vocab_size, cfg.hidden_size), (cfg.hidden_size, cfg.vocab_size)}
    found = []
    for dims, kind in re.findall(r"= \w+\[([\d,]*)\]\S* (copy|transpose)\(", hlo):
        shape = tuple(int(d) for d in dims.split(",") if d)
        if shape[-4:] in cache or shape[-3:] in cache or shape in table:
            found.append(f"{kind} [{dims}]")
    return found


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", nargs="+", default=["smollm2"], help="model names or converted directories")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--length", type=int, default=256, help="cache slots")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--unrolled", action="store_true", help="also time each stacked model unrolled")
    args = p.parse_args(argv)
    load = load_average()
    from cmoe_jax.loading import load_model

    models = {name: load_model(name, progress=False).model for name in args.model}
    if args.unrolled:
        models.update({f"{name} (unrolled)": m.unstacked() for name, m in list(models.items())
                       if m.unstacked() is not m})
    print(machine_line(), flush=True)
    for batch in args.batch:
        steps = {name: compiled_step(m, batch, args.length) for name, m in models.items()}
        times = interleaved_times([run for run, _ in steps.values()], args.repeats)
        for (name, (_, hlo)), ts in zip(steps.items(), times):
            copies = whole_copies(models[name], hlo, batch, args.length)
            print(f"batch={batch:<3d} {name}: median {statistics.median(ts) * 1e3:.2f} ms  "
                  f"min {min(ts) * 1e3:.2f} ms  whole-cache/table copies {len(copies)}", flush=True)
    print_load(load, args.repeats, ratio=False)


if __name__ == "__main__":
    main()

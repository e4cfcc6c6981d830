"""One KV-cache decode step of each model, timed, and what its compiled program copies.

    python benchmarks/decode_step.py [--model smollm2 out/u025 ...] [--batch 1 16]
        [--length 256] [--repeats 40] [--unrolled] [--paths auto gather sort padded dense]
        [--ffn-floor]

Each model's jitted decode step (`cmoe_jax.generate.engine`'s, one token a row over a cache
of `--length` slots) is compiled and run `--repeats` times, the models interleaved after a
warm-up. For each model and batch it prints the median step time and the copies and
transposes in the compiled step whose shape is a layer's whole cache or the embedding table:
the arrays a step should read where they lie. `--unrolled` also times each model whose layers
stack run unrolled, with a cache of its own for each layer, as a model of differing layers
runs. `--paths` times each model with MoE layers once per dispatch path, every layer forced
to it ("auto": the rule), so the rule can be checked on whole steps, whose weights come from
memory, where the layer grid's stay in cache. With `--data-path` (WikiText-2 test text) the
step is the one after a prefill of `--prompt-len` tokens a row, so it routes as real
decoding does (more unevenly than random tokens over an empty cache). `--ffn-floor` adds,
for each dense model, the same model with an FFN of width 8 (random weights): what a step
costs beyond its FFN, from which the ideal ratio of a converted model's step follows. To
compare two versions of the code, run it in a checkout of each, alternately, on a quiet
machine (the load average is printed).
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import interleaved_times, load_average, machine_line, print_load  # noqa: E402
from cmoe_jax.moe.checks import DISPATCHES  # noqa: E402


def compiled_step(model, batch: int, length: int, slot: int = 10, prompts=None):
    """(a zero-argument callable running one decode step, blocking; the compiled step's HLO
    text): one random token a row written at `slot` of a cache of `length` slots, or, with
    `prompts` (int `[batch, W]`), the greedy token after them, their prefill in the cache."""
    import jax
    import jax.numpy as jnp

    from cmoe_jax.generate import engine
    from cmoe_jax.sharding import make_mesh, placed_split

    graphdef, state = placed_split(model, make_mesh())
    leaves, treedef = jax.tree.flatten(state)
    jitted = engine._jitted_step(graphdef, treedef)
    ones = jnp.ones((batch, 1), jnp.int32)
    knobs = engine.Knobs(jnp.float32(1), jnp.int32(0), jnp.float32(1))
    key = jax.random.PRNGKey(0)
    cache = model.empty_cache(batch, length)
    if prompts is None:
        # a different token a row: one token in every row would route the batch to one expert
        tokens = jax.random.randint(jax.random.key(1), (batch, 1), 100, model.config.vocab_size)
        cache = cache.mark(ones.astype(bool), slot)
    else:
        prompts = jnp.asarray(prompts, jnp.int32)
        width = prompts.shape[1]
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), prompts.shape)
        tokens, cache = jitted(leaves, cache, engine.StepInput(prompts, prompts >= 0, positions, jnp.int32(0)),
                               key, knobs, greedy=True)
        slot = width
    step = engine.StepInput(jnp.asarray(tokens).reshape(batch, 1).astype(jnp.int32), ones.astype(bool),
                            ones * slot, jnp.int32(slot))
    compiled = jitted.lower(leaves, cache, step, key, knobs, greedy=True).compile()
    held = [cache]

    def run():  # the step donates its cache: the next one runs on this one's
        token, new = compiled(leaves, held.pop(), step, key, knobs)
        jax.block_until_ready(token)
        held.append(new)
    return run, compiled.as_text()


def moe_layers(model) -> list:
    """The model's MoE layers (a stacked run has one, its template)."""
    from flax import nnx

    from cmoe_jax.moe import MoELayer
    return [m for _, m in nnx.iter_graph(model) if isinstance(m, MoELayer)]


def forced_step(model, path: str, batch: int, length: int, prompts=None):
    """`compiled_step` with every MoE layer of `model` forced to dispatch `path`."""
    layers = moe_layers(model)
    for m in layers:
        m.dispatch = path
    try:
        return compiled_step(model, batch, length, prompts=prompts)
    finally:
        for m in layers:
            m.dispatch = "auto"


def without_ffn(model):
    """`model`'s architecture with an FFN of width 8 and random weights (a dense model only)."""
    import dataclasses

    from flax import nnx

    from cmoe_jax.models.decoder import Decoder
    cfg = dataclasses.replace(model.config, intermediate_size=8)
    return Decoder(cfg, dtype=model.dtype, rngs=nnx.Rngs(0))


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
    p.add_argument("--paths", nargs="+", default=["auto"], choices=DISPATCHES,
                   help="each model with MoE layers timed with them forced to these paths (auto: the rule)")
    p.add_argument("--ffn-floor", action="store_true",
                   help="also time each dense model with an FFN of width 8: the step beyond its FFN")
    p.add_argument("--data-path", type=Path, help="prompt text (WikiText-2 test): the step follows the "
                   "prefill of --prompt-len tokens a row (default: a random token a row, empty cache)")
    p.add_argument("--prompt-len", type=int, default=128)
    args = p.parse_args(argv)
    if args.data_path is not None and not args.data_path.is_file():
        p.error(f"--data-path {args.data_path} is not a file: give a text file, e.g. WikiText-2's test.txt")
    if args.data_path is not None and args.prompt_len >= args.length:
        p.error(f"--prompt-len {args.prompt_len} leaves no cache slot of --length {args.length} for the step")
    load = load_average()
    from cmoe_jax.loading import load_model

    loaded = {name: load_model(name, progress=False) for name in args.model}
    models = {name: lm.model for name, lm in loaded.items()}
    if args.unrolled:
        models.update({f"{name} (unrolled)": m.unstacked() for name, m in list(models.items())
                       if m.unstacked() is not m})
    if args.ffn_floor:
        models.update({f"{name} (FFN of width 8)": without_ffn(m) for name, m in list(models.items())
                       if not moe_layers(m)})
    pool = None
    if args.data_path is not None:
        from cmoe_jax.data import load_text_tokens
        tokens = load_text_tokens("wikitext2", loaded[args.model[0]].tokenizer, "test", str(args.data_path))
        pool = tokens[:max(args.batch) * args.prompt_len].reshape(max(args.batch), args.prompt_len)
    print(machine_line(), flush=True)
    for batch in args.batch:
        steps, of = {}, {}
        prompts = None if pool is None else pool[:batch]
        for name, m in models.items():
            for path in args.paths if moe_layers(m) else ["auto"]:
                label = name if path == "auto" else f"{name} ({path})"
                steps[label], of[label] = forced_step(m, path, batch, args.length, prompts), name
        times = interleaved_times([run for run, _ in steps.values()], args.repeats)
        for (name, (_, hlo)), ts in zip(steps.items(), times):
            copies = whole_copies(models[of[name]], hlo, batch, args.length)
            print(f"batch={batch:<3d} {name}: median {statistics.median(ts) * 1e3:.2f} ms  "
                  f"min {min(ts) * 1e3:.2f} ms  whole-cache/table copies {len(copies)}", flush=True)
    print_load(load, args.repeats, ratio=False)


if __name__ == "__main__":
    main()

"""Is a layer-adaptive conversion as fast as the uniform one of the same budget?

    python benchmarks/budget_speed.py --uniform out/u025 --adaptive out/a025 [--model smollm2]
        [--batches 1 16] [--prompt-len 128] [--new-tokens 128] [--prefill-len 512] [--repeats 3]
        [--unrolled] [--parts prefill decode] [--memory]

The dense model and the two converted ones (their directories as `cmoe-jax convert` wrote
them) run the same work, interleaved in one process after a compiling warm-up: prefill (a
batch of `--prefill-len`-token WikiText-2 test prompts through the model, the last position's
logits) and decode (`--new-tokens` greedy tokens after a `--prompt-len`-token prompt, KV
cache, no early stop), batch 1 and 16. Each block prints every side's median and min, and ends with

    ratio adaptive/uniform decode batch=1: N.NNx      (uniform time / adaptive time)
    ratio uniform/dense decode batch=1: N.NNx         (dense time / uniform time)

so 0.95x or more is "within 5% of uniform". `--unrolled` adds a fourth side, the adaptive
model with one module per layer run unrolled (`Decoder.unstacked`), against the runs of
same-shape layers it scans (`ratio adaptive/unrolled`: unrolled time / scanned time). Ratios are withheld with a `warning:` when the
load average at start exceeds the core count. `--memory` prints instead, for every side and
batch, what XLA's compiled prefill program holds (`memory_analysis()`: the weights it is
given, its temporaries, its output), and times nothing.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.decode import ours_side  # noqa: E402
from benchmarks.harness import WIKITEXT, interleaved_times, load_average, machine_busy, machine_line, print_load  # noqa: E402
from benchmarks.prefill import prefill_fn, prefill_program  # noqa: E402


def sides(models: dict, what: str, prompts: np.ndarray, new_tokens: int) -> list:
    """One zero-argument callable per model that blocks until its result is ready."""
    import jax

    if what == "decode":
        return [ours_side(m, prompts, new_tokens) for m in models.values()]
    fns = [prefill_fn(m) for m in models.values()]
    return [lambda f=f: jax.block_until_ready(f(prompts)) for f in fns]


def print_memory(models: dict, pool: np.ndarray, batches, length: int) -> None:
    """Each side's compiled prefill program: argument (weights), temporary and output MiB."""
    for batch in batches:
        for name, model in models.items():
            run, state = prefill_program(model)
            mem = run.lower(state, pool[:batch, :length]).compile().memory_analysis()
            mib = [getattr(mem, f"{k}_size_in_bytes") / 2 ** 20 for k in ("argument", "temp", "output")]
            print(f"memory  prefill batch={batch:<3d} {name:9s} weights {mib[0]:8.1f} MiB  temporaries "
                  f"{mib[1]:8.1f} MiB  output {mib[2]:6.1f} MiB", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="the dense source of both conversions")
    p.add_argument("--uniform", required=True, help="the uniform conversion's directory")
    p.add_argument("--adaptive", required=True, help="the layer-adaptive conversion's directory")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=128, help="decode: prompt tokens")
    p.add_argument("--new-tokens", type=int, default=128, help="decode: greedy tokens generated")
    p.add_argument("--prefill-len", type=int, default=512, help="prefill: prompt tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--parts", nargs="+", choices=["prefill", "decode"], default=["prefill", "decode"],
                   help="which work to time (both by default)")
    p.add_argument("--unrolled", action="store_true",
                   help="also time the adaptive model unrolled, one module per layer")
    p.add_argument("--memory", action="store_true",
                   help="print each side's compiled prefill memory instead of timing")
    p.add_argument("--data-path", type=Path, default=WIKITEXT / "test.txt", help="prompt text (WikiText-2 test)")
    args = p.parse_args(argv)
    load_start = load_average()

    from cmoe_jax.data import load_text_tokens
    from cmoe_jax.loading import load_model

    lm = load_model(args.model, progress=False)
    models = {"dense": lm.model, "uniform": load_model(args.uniform, progress=False).model,
              "adaptive": load_model(args.adaptive, progress=False).model}
    if args.unrolled:
        models["unrolled"] = models["adaptive"].unstacked()
    tokens = load_text_tokens("wikitext2", lm.tokenizer, "test", str(args.data_path))
    longest = max(args.prompt_len, args.prefill_len)
    pool = np.asarray(tokens[:max(args.batches) * longest], np.int32).reshape(max(args.batches), longest)
    print(machine_line())
    print(f"model: {args.model}; uniform {args.uniform}, adaptive {args.adaptive}; prefill {args.prefill_len} "
          f"tokens; decode {args.new_tokens} new after {args.prompt_len}; batches {args.batches}", flush=True)
    if args.memory:
        return print_memory(models, pool, args.batches, args.prefill_len)
    medians = {}
    for batch in args.batches:
        for what, length in (("prefill", args.prefill_len), ("decode", args.prompt_len)):
            if what not in args.parts:
                continue
            times = interleaved_times(sides(models, what, pool[:batch, :length], args.new_tokens), args.repeats)
            for name, ts in zip(models, times):
                medians[name, what, batch] = statistics.median(ts)
                print(f"{what:7s} batch={batch:<3d} {name:9s} median {medians[name, what, batch]:8.3f} s"
                      f"  min {min(ts):8.3f} s", flush=True)
    busy = print_load(load_start, args.repeats) or machine_busy(load_start)
    for batch in args.batches:
        for what in [w for w in ("prefill", "decode") if w in args.parts]:
            pairs = [("adaptive", "uniform"), ("uniform", "dense"), ("adaptive", "dense")]
            for a, ref in pairs + ([("adaptive", "unrolled")] if args.unrolled else []):
                value = "withheld (machine busy)" if busy else \
                    f"{medians[ref, what, batch] / medians[a, what, batch]:.2f}x"
                print(f"ratio {a}/{ref} {what} batch={batch}: {value}")


if __name__ == "__main__":
    main()

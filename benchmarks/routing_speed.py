"""Threshold routing against top-k at inference: the same plan converted both ways, timed on
a whole-model prefill and on greedy decoding, with the dense model beside them.

    python benchmarks/routing_speed.py --topk DIR --threshold DIR [--model smollm2]
        [--prefill-tokens 2048] [--batches 1 16] [--prompt-len 128] [--new-tokens 64] [--repeats 3]

`--topk` and `--threshold` are conversions of one plan (`cmoe-jax convert --config S3A3E8`, the
second with `--routing threshold`). A threshold-routed layer's dispatch is sized for its cap
(every routed expert), which the platform's rule (`cmoe_jax.moe.modes`) may run as the dense
path; this measures what that costs. The three sides alternate after a warm-up
(`benchmarks/harness.py`); the last lines are threshold-time / top-k-time of the medians (a
ratio above 1: threshold routing is slower), withheld when the load average at start exceeds
the core count.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode import ours_side  # noqa: E402
from benchmarks.harness import WIKITEXT, interleaved_times, load_average, machine_line, print_load  # noqa: E402
from benchmarks.prefill import prefill_fn  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="the dense source of both conversions")
    p.add_argument("--topk", required=True, type=Path)
    p.add_argument("--threshold", required=True, type=Path)
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--data-dir", type=Path, default=WIKITEXT)
    args = p.parse_args(argv)
    load_start = load_average()

    import jax.numpy as jnp

    from cmoe_jax.data import load_text_tokens, text_windows
    from cmoe_jax.loading import load_model

    dense = load_model(args.model, progress=False)
    models = {"dense": dense.model, "top-k": load_model(str(args.topk), progress=False).model,
              "threshold": load_model(str(args.threshold), progress=False).model}
    assert all(s.threshold_routing for s in models["threshold"].config.moe_layers if s is not None)
    test = load_text_tokens("wikitext2", dense.tokenizer, "test", args.data_dir / "test.txt")
    print(machine_line())
    window = jnp.asarray(text_windows(test, args.prefill_tokens, 1))
    runs = {name: prefill_fn(m) for name, m in models.items()}
    times = interleaved_times([lambda r=r: r(window).block_until_ready() for r in runs.values()], args.repeats)
    medians = {name: statistics.median(t) for name, t in zip(runs, times)}
    print(f"prefill 1x{args.prefill_tokens}: " + ", ".join(f"{n} {s:.3f} s" for n, s in medians.items()))
    ratios = [f"ratio threshold/top-k prefill: {medians['threshold'] / medians['top-k']:.2f}x"]
    for batch in args.batches:
        rows = [np.asarray(w) for w in text_windows(test, args.prompt_len, batch)]
        sides = [ours_side(m, rows, args.new_tokens) for m in models.values()]
        times = interleaved_times(sides, args.repeats)
        medians = {name: statistics.median(t) for name, t in zip(models, times)}
        print(f"decode batch {batch}, {args.new_tokens} tokens: "
              + ", ".join(f"{n} {batch * args.new_tokens / s:.1f} tok/s" for n, s in medians.items()))
        ratios.append(f"ratio threshold/top-k decode batch={batch}: {medians['threshold'] / medians['top-k']:.2f}x")
    if not print_load(load_start, args.repeats):
        print("\n".join(ratios))


if __name__ == "__main__":
    main()

"""The README's ConMoE table: WikiText-2 perplexity of every variant of one MoE base.

Loads the base once, collects the calibration statistics once (the CLI's defaults: 8 x 2048
WikiText-2 validation tokens, seed 0; cached in --stats), then builds each variant in memory
(`conmoe_plans` / `baseline_plans` + `apply_plans`, exactly what `python -m cmoe_jax.compress`
saves) and measures its perplexity on the first 40 WikiText-2 test windows of 2048 tokens
(the protocol of `python -m cmoe_jax.eval --dataset wikitext2 --max-windows 40`). One JSON line
per variant goes to --out; variants already there are skipped (rerun to continue).

    python benchmarks/conmoe_table.py --model bases/smollm2-S3A3E8 --out s3.jsonl
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from cmoe_jax.compress import apply_plans, baseline_plans, collect_stats, conmoe_plans, routed_bytes
from cmoe_jax.compress.calibration import LayerStats
from cmoe_jax.data import calibration_windows, eval_windows, load_text_tokens
from cmoe_jax.eval.perplexity import perplexity
from cmoe_jax.loading import load_model

WIKITEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"  # beside the checkout
CORE = [("conmoe", 1, "adaptive"), ("frequency", 1, ""), ("reap", 1, ""), ("conmoe", 4, "adaptive"),
        ("msmoe", 1, ""), ("hcsmoe", 1, "")]
MORE = [("conmoe", 4, "fixed"), ("conmoe", 4, "usage"), ("conmoe", 4, "reap"),
        ("conmoe", 4, "distance"), ("conmoe", 2, "adaptive"), ("conmoe", 8, "adaptive"),
        ("conmoe", 30, "adaptive")]


def variants(ratios):
    for group in (CORE, MORE):
        for ratio in ratios:
            for method, scope, selection in group:
                yield method, ratio, scope, selection


def stats_for(model, tokenizer, cache: Path, data_dir: str):
    if cache.exists():
        with np.load(cache) as z:
            layers = sorted({int(k.split("/")[0]) for k in z.files})
            return {l: LayerStats.from_npz({f: z[f"{l}/{f}"] for f in
                                            ("freq", "contrib", "mean_out", "logit_gram", "tokens")})
                    for l in layers}
    windows = calibration_windows(load_text_tokens("wikitext2", tokenizer, data_path=f"{data_dir}/valid.txt"),
                                  8, 2048, 0)
    stats = collect_stats(model, windows)
    np.savez(cache, **{f"{l}/{k}": v for l, s in stats.items() for k, v in s.to_npz().items()})
    return stats


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stats", required=True)
    p.add_argument("--ratios", default="0.5,0.25")
    p.add_argument("--windows", type=int, default=40)
    p.add_argument("--data-dir", default=str(WIKITEXT),
                   help="folder with WikiText-2 valid.txt and test.txt (default: %(default)s)")
    args = p.parse_args()
    lm = load_model(args.model, dtype=jnp.float32)
    stats = stats_for(lm.model, lm.tokenizer, Path(args.stats), args.data_dir)
    test = eval_windows(load_text_tokens("wikitext2", lm.tokenizer, data_path=f"{args.data_dir}/test.txt"),
                        "wikitext2", 2048, args.windows, name="wikitext2 test")
    out = Path(args.out)
    done = {tuple(json.loads(l)["key"]) for l in out.read_text().splitlines()} if out.exists() else set()
    todo = [("base", 0.0, 1, "")] + list(variants([float(r) for r in args.ratios.split(",")]))
    for method, ratio, scope, selection in todo:
        key = [method, ratio, scope, selection]
        if tuple(key) in done:
            continue
        t0 = time.perf_counter()
        if method == "base":
            model, figures, k = lm.model, {}, sum(len(s.freq) for s in stats.values())
        else:
            plans, figures = (conmoe_plans(lm.model, stats, ratio, scope, selection) if method == "conmoe"
                              else (baseline_plans(method, stats, ratio), {}))
            model, k = apply_plans(lm.model, plans), sum(p.num_prototypes for p in plans)
        ppl = perplexity(model, test, progress=False)["ppl"]
        row = {"key": key, "ppl": ppl, "prototypes": k, "routed_bytes": routed_bytes(model),
               **figures, "seconds": time.perf_counter() - t0, "load": os.getloadavg()[0]}
        print(json.dumps(row), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        del model
        jax.clear_caches()  # each variant compiles its own step; keep memory flat
        gc.collect()


if __name__ == "__main__":
    main()

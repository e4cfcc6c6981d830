"""The labelled baseline of the README's hierarchical table: every routed expert of a converted
(or HF) MoE split into random sub-experts with a random sub-router, at the same per-expert
plan (so the same active width) as the CMoE carving; WikiText-2 perplexity on the test split.

    python benchmarks/hier_random_baseline.py --model bases/smollm2-S1A1E8 --config S1A1E4 \
        --data-path ../shared/data/wikitext-2/test.txt --windows 40 [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import load_average  # noqa: E402
from cmoe_jax.methods.cmoe import MoEPlan  # noqa: E402
from cmoe_jax.checkpoint import is_converted  # noqa: E402
from cmoe_jax.convert import ConvertConfig  # noqa: E402
from cmoe_jax.methods.hierarchical import random_hierarchical  # noqa: E402
from cmoe_jax.data import load_text_tokens, text_windows  # noqa: E402
from cmoe_jax.eval import perplexity  # noqa: E402
from cmoe_jax.loading import load_model, load_tokenizer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--config", default="S1A1E4")
    p.add_argument("--router-neurons", type=int, default=8)
    p.add_argument("--data-path", required=True)
    p.add_argument("--windows", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    args = p.parse_args()
    print(f"load average at start {load_average():.2f}")
    lm = load_model(args.model, progress=False)
    path = Path(args.model)
    tokenizer = load_tokenizer(path / "tokenizer" if is_converted(path) else path)
    cc = ConvertConfig(plan=MoEPlan.parse(args.config), router_neurons=args.router_neurons, seed=args.seed)
    t0 = time.perf_counter()
    model = random_hierarchical(lm.model, cc)
    seconds = time.perf_counter() - t0
    test = text_windows(load_text_tokens("wikitext2", tokenizer, "test", args.data_path), 2048,
                        max_windows=args.windows)
    result = perplexity(model, test)
    out = {"model": args.model, "config": args.config, "baseline": "random sub-partition + random sub-router",
           "seed": args.seed, "windows": args.windows, "ppl": result["ppl"], "build_seconds": seconds,
           "load_average_end": load_average()}
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""CMoE's departures from the paper, one at a time, on one model: perplexity x dense per
variant and shape (the ablation table of docs/results/cmoe.md).

    python benchmarks/cmoe_ablation.py --model gemma3-270m --configs S3A3E8 S1A1E8 \
        --variants defaults paper authors --max-windows 10 --json out.json

Variants (each converts from scratch with seed 0 and is evaluated on the first
`--max-windows` WikiText-2 test windows of 2048 tokens, BOS-opened where the family's
tokenizer adds one):
- `defaults`: `cmoe-jax convert` with no option;
- `authors`: the authors' carving (`benchmarks/cmoe_authors_reference.authors_carving`:
  torch.topk shared set, one L1 K-means step by lapjv, centroid-closest representative) with
  the paper's router, run through the project's calibration pass and MoE layer;
- `paper`: the project's own carving with the paper's settings (`--paper-router
  --kmeans-iters 1`);
- one variant per departure, each the defaults with that one choice set back or changed
  (`VARIANTS` below); `...calib-bos` (`--calib-bos`: each window opened with BOS, as
  Gemma's evaluation windows) / `authors-sampler` change the calibration windows instead.

`--stream DIR` converts through the conversion job with `--stream` (one layer in memory at a
time, written under DIR, restored for the evaluation, then removed) instead of a copy of the
loaded model: for a model whose dense and converted copies do not fit together (the 1.5B).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import WIKITEXT  # noqa: E402

PAPER = {"router_neurons": 1, "router_reps": "centroid", "router_scale": False, "gate_fit": False,
         "down_fit": 0.0, "kmeans_iters": 1}
VARIANTS = {
    "defaults": {},
    "paper": PAPER,
    "authors": PAPER,
    "authors-calib-bos": PAPER,
    "kmeans-1-step": {"kmeans_iters": 1},
    "centroid-reps": {"router_reps": "centroid"},
    "1-router-neuron": {"router_neurons": 1},
    "no-router-scale": {"router_scale": False},
    "shared-by-energy": {"shared_by": "energy"},
    "shared-by-rate": {"shared_by": "rate"},
    "no-normalize": {"normalize": False},
    "no-gate-fit": {"gate_fit": False},
    "16-router-neurons": {"router_neurons": 16},
    "24-router-neurons": {"router_neurons": 24},
    "32-router-neurons": {"router_neurons": 32},
    "fit-8192-tokens": {"router_fit_tokens": 8192},
    "no-down-fit": {"down_fit": 0.0},
    "down-fit-0.01": {"down_fit": 0.01},
    "down-fit-0.1": {"down_fit": 0.1},
    "down-fit-0.001": {"down_fit": 0.001},
    "down-fit-0.3": {"down_fit": 0.3},
    "down-fit-1": {"down_fit": 1.0},
    "skip-compensation": {"skip_compensation": True},
    "skip-compensation-ridge-1": {"skip_compensation": True, "down_fit": 1.0},
    "threshold-routing": {"routing": "threshold"},
    "threshold-routing-skip-compensation": {"routing": "threshold", "skip_compensation": True},
    "threshold-routing-calib-bos": {"routing": "threshold"},
    "calib-bos": {},
    "authors-sampler": {},
}


def windows(lm, args):
    """(validation tokens, the family's BOS id or None, test windows) for the model's tokenizer."""
    from cmoe_jax.data import load_text_tokens, text_windows
    from cmoe_jax.loading import window_bos

    valid = load_text_tokens("wikitext2", lm.tokenizer, "validation", args.data_dir / "valid.txt")
    test = load_text_tokens("wikitext2", lm.tokenizer, "test", args.data_dir / "test.txt")
    bos = window_bos(lm.config, lm.tokenizer)
    return valid, bos, text_windows(test, 2048, args.max_windows, bos=bos)


def run(lm, valid, bos, test, config: str, variant: str, samples: int = 8) -> dict:
    import copy

    from benchmarks.cmoe_authors_reference import calibration
    from cmoe_jax.convert import convert_model
    from cmoe_jax.eval import perplexity

    with carving_of(variant):
        t0 = time.perf_counter()
        moe, _ = convert_model(copy.deepcopy(lm.model), calibration(valid, bos, variant, n=samples),
                               variant_config(config, variant), progress=False)
        seconds = time.perf_counter() - t0
    out = {"config": config, "variant": variant, "calib_samples": samples,
           "ppl": perplexity(moe, test, progress=False)["ppl"], "convert_s": round(seconds, 1)}
    if VARIANTS[variant].get("routing") == "threshold":
        out["test_active_share"] = test_share(moe, test, config)
    return out


def test_share(model, test, config: str) -> float:
    """The share of the FFN's neurons a token ran on the test windows, over every layer:
    under threshold routing a token runs as many routed experts as pass the threshold, so
    the plan's share holds on the calibration tokens only."""
    import jax
    from flax import nnx

    from cmoe_jax.methods.cmoe import MoEPlan

    plan = MoEPlan.parse(config)
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda state, toks: nnx.merge(graphdef, state).run_layers(toks)[2])
    per_token = []
    for window in test:
        loads = run(state, np.asarray(window, np.int32)[None])
        per_token.append(np.mean([int(np.asarray(v).sum()) for v in loads.values()]) / len(window))
    return float((plan.shared + np.mean(per_token)) / plan.total)


def run_streamed(model: str, test, config: str, variant: str, args) -> dict:
    """`run` through the conversion job with `--stream`, the result written under
    `args.stream`, restored for the evaluation and removed (the project's calibration sampler:
    the variants that change the windows are refused)."""
    import shutil

    from cmoe_jax.convert import Calibration, ConvertSettings, convert
    from cmoe_jax.eval import perplexity
    from cmoe_jax.loading import load_model

    if variant == "authors-sampler":
        raise SystemExit(f"error: --stream runs the project's calibration windows; drop {variant}")
    out = args.stream / f"{config}-{variant}"
    settings = ConvertSettings(method=variant_config(config, variant), stream=True,
                               calibration=Calibration(data_path=str(args.data_dir / "valid.txt"),
                                                       samples=args.calib_samples,
                                                       bos=variant.endswith("calib-bos")))
    with carving_of(variant):
        t0 = time.perf_counter()
        convert(model, settings, out=out, overwrite=True, progress=False)
        seconds = time.perf_counter() - t0
    ppl = perplexity(load_model(str(out), progress=False).model, test, progress=False)["ppl"]
    shutil.rmtree(out)
    return {"config": config, "variant": variant, "calib_samples": args.calib_samples, "stream": True,
            "ppl": ppl, "convert_s": round(seconds, 1)}


def variant_config(config: str, variant: str):
    from cmoe_jax.convert import ConvertConfig
    from cmoe_jax.methods.cmoe import MoEPlan

    return ConvertConfig(plan=MoEPlan.parse(config), **VARIANTS[variant])


@contextlib.contextmanager
def carving_of(variant: str):
    """The conversion's carve, the authors' one while `variant` is `authors...`."""
    from cmoe_jax.methods.cmoe import convert as cmoe_convert

    carve = cmoe_convert.carve_profiled
    if variant.startswith("authors") and variant != "authors-sampler":
        cmoe_convert.carve_profiled = _authors_carve
    try:
        yield
    finally:
        cmoe_convert.carve_profiled = carve


def _authors_carve(markers, mu, energy, cc, plan):
    import torch

    from benchmarks.cmoe_authors_reference import authors_carving
    from cmoe_jax.methods.cmoe import LayerCarving

    c = authors_carving(torch.from_numpy(np.asarray(markers, np.float32)),
                        torch.from_numpy(np.asarray(mu, np.float32)), plan.shared, plan.total)
    return LayerCarving(c.shared, c.experts, c.representatives[:, None], 1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--configs", nargs="+", default=["S3A3E8", "S1A1E8"])
    p.add_argument("--variants", nargs="+", default=["defaults", "paper", "authors"],
                   choices=sorted(VARIANTS))
    p.add_argument("--max-windows", type=int, default=10)
    p.add_argument("--calib-samples", type=int, default=8, help="calibration windows of 2048 tokens")
    p.add_argument("--data-dir", type=Path, default=WIKITEXT,
                   help="folder with WikiText-2's valid.txt and test.txt")
    p.add_argument("--json", type=Path, help="append each result as one JSON line")
    p.add_argument("--stream", type=Path, metavar="DIR",
                   help="convert streamed into DIR (one layer in memory), then restore and evaluate")
    args = p.parse_args(argv)

    from cmoe_jax.eval import perplexity
    from cmoe_jax.loading import load_model

    lm = load_model(args.model, progress=False)
    valid, bos, test = windows(lm, args)
    dense = perplexity(lm.model, test, progress=False)["ppl"]
    if args.stream:
        del lm  # each conversion reads the checkpoint again
    print(f"{args.model}: dense ppl {dense:.4f} on {len(test)} windows", flush=True)
    print("| config | variant | ppl | x dense | conversion (s) |\n| --- | --- | --- | --- | --- |", flush=True)
    for config in args.configs:
        for variant in args.variants:
            r = (run_streamed(args.model, test, config, variant, args) if args.stream
                 else run(lm, valid, bos, test, config, variant, args.calib_samples))
            r.update(model=args.model, dense_ppl=dense, windows=len(test), x_dense=r["ppl"] / dense)
            share = f" (test share {r['test_active_share']:.3f})" if "test_active_share" in r else ""
            print(f"| {config} | {variant} | {r['ppl']:.3f} | {r['x_dense']:.3f}x | {r['convert_s']}{share} |",
                  flush=True)
            if args.json:
                with args.json.open("a") as f:
                    f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()

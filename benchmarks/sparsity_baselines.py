"""WikiText-2 perplexity of SmolLM2-135M with its FFNs made sparse by the ExpertWeaver paper's
baselines (AbsTopk-GLU, magnitude, Wanda), evaluated in-process on the README's 40 windows.

    python benchmarks/sparsity_baselines.py --sparsity 0.25 0.5 [--methods abstopk magnitude wanda]
        [--windows 40] [--json out.json]

Wanda's input norms come from the conversions' calibration (8 random 2048-token windows of
the WikiText-2 validation file, seed 0), layer by layer through the already-pruned layers
(as Wanda's code does). Prints one line per (method, sparsity) with the perplexity, the load
average before and after, and the seconds the pruning took.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import WIKITEXT  # noqa: E402


def wanda_layerwise(model, calib, sparsity: float) -> None:
    """Wanda on `model` (listed layers, pruned in place) through the project's layer pass:
    each FFN is pruned on the inputs the already-pruned layers before it produce."""
    from benchmarks.sparsity_baselines_lib import prune_ffn
    from cmoe_jax.calibration_pass.layer_pass import calibration_mesh, layer_pass, start_pass

    def prune(inputs):
        prune_ffn(inputs.layer.mlp, sparsity, "wanda", inputs.ffn_input)
        return inputs.layer.mlp

    mesh = calibration_mesh(calib.shape[0])
    h, rope = start_pass(model, calib, mesh)
    layer_pass(model.layers, h, rope, mesh, prune, desc="wanda", progress=False)


def sparse_model(method: str, sparsity: float, calib):
    from benchmarks.sparsity_baselines_lib import AbsTopkGLU, prune_ffn
    from cmoe_jax.loading import load_model

    model = load_model("smollm2", progress=False).model.unstacked()  # layers edited in place
    if method == "abstopk":
        keep = int(round((1 - sparsity) * model.config.intermediate_size))
        for layer in model.layers:
            layer.mlp = AbsTopkGLU(layer.mlp, keep)
    elif method == "magnitude":
        for layer in model.layers:
            prune_ffn(layer.mlp, sparsity, "magnitude")
    elif method == "wanda":
        wanda_layerwise(model, calib, sparsity)
    elif method != "dense":
        raise ValueError(method)
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sparsity", type=float, nargs="+", default=[0.25, 0.5])
    p.add_argument("--methods", nargs="+", default=["abstopk", "magnitude", "wanda"])
    p.add_argument("--windows", type=int, default=40)
    p.add_argument("--json")
    p.add_argument("--data-dir", default=str(WIKITEXT),
                   help="folder with WikiText-2 valid.txt and test.txt (default: %(default)s)")
    args = p.parse_args()

    from cmoe_jax.data import calibration_windows, eval_windows, load_text_tokens
    from cmoe_jax.eval.perplexity import perplexity
    from cmoe_jax.loading import load_model

    tok = load_model("smollm2", progress=False).tokenizer
    test = eval_windows(load_text_tokens("wikitext2", tok, data_path=f"{args.data_dir}/test.txt"), "wikitext2",
                        2048, args.windows)
    calib = calibration_windows(load_text_tokens("wikitext2", tok, data_path=f"{args.data_dir}/valid.txt"),
                                8, 2048, 0)
    rows = []
    for sparsity in args.sparsity:
        for method in args.methods:
            load0 = os.getloadavg()[0]
            t0 = time.perf_counter()
            model = sparse_model(method, sparsity, calib)
            t_prune = time.perf_counter() - t0
            r = perplexity(model, test, progress=False)
            row = {"method": method, "sparsity": sparsity, "ppl": r["ppl"], "prune_seconds": t_prune,
                   "eval_seconds": r["seconds"], "load_before": load0, "load_after": os.getloadavg()[0]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

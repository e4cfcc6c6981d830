"""Per-layer relative error of converted FFNs against the dense FFN, on the dense model's own
FFN inputs: where a conversion loses accuracy (ExpertWeaver vs CMoE vs AbsTopk-GLU).

    python benchmarks/ffn_layer_error.py DIR... [--abstopk 0.25] [--windows 2] [--json out.json]

Inputs: the dense SmolLM2's FFN inputs on the first `--windows` 2048-token WikiText-2 test
windows. Error of layer l: ||FFN_conv(x_l) - FFN_dense(x_l)||_F / ||FFN_dense(x_l)||_F.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
WIKITEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"  # beside the checkout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dirs", nargs="*")
    p.add_argument("--abstopk", type=float, nargs="*", default=[], help="also AbsTopk-GLU at these sparsities")
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--data-dir", default=str(WIKITEXT),
                   help="folder with WikiText-2 valid.txt and test.txt (default: %(default)s)")
    args = p.parse_args()
    import jax

    from benchmarks.sparsity_baselines_lib import abstopk_glu
    from cmoe_jax.data import eval_windows, load_text_tokens
    from cmoe_jax.loading import load_model

    lm = load_model("smollm2", progress=False)
    dense = lm.model
    toks = eval_windows(load_text_tokens("wikitext2", lm.tokenizer,
                                         data_path=f"{args.data_dir}/test.txt"),
                        "wikitext2", 2048, args.windows)
    _, xs = jax.jit(lambda t: dense(t, capture_ffn_inputs=True))(toks)
    ys = [np.asarray(layer.mlp(x)) for layer, x in zip(dense.layers, xs)]

    def rel(y, y0):
        return float(np.linalg.norm(np.asarray(y) - y0) / np.linalg.norm(y0))

    table = {}
    for s in args.abstopk:
        keep = int(round((1 - s) * dense.config.intermediate_size))
        table[f"abstopk{s}"] = [rel(abstopk_glu(x, l.mlp.gate[...], l.mlp.up[...], l.mlp.down[...], keep), y0)
                                for l, x, y0 in zip(dense.layers, xs, ys)]
    for d in args.dirs:
        conv = load_model(d, progress=False).model
        table[Path(d).name] = [rel(jax.jit(lambda m, x: m(x))(l.mlp, x), y0)
                               for l, x, y0 in zip(conv.layers, xs, ys)]
    names = list(table)
    print("layer " + " ".join(f"{n:>14}" for n in names))
    for i in range(len(ys)):
        print(f"{i:5d} " + " ".join(f"{table[n][i]:14.4f}" for n in names))
    print("mean  " + " ".join(f"{np.mean(table[n]):14.4f}" for n in names))
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()

"""Per-layer relative error of converted FFNs against the dense FFN, on the dense model's own
FFN inputs: where a conversion loses accuracy (ExpertWeaver vs CMoE vs AbsTopk-GLU), and with
`--oracle` whether the partition or the router limits it.

    python benchmarks/ffn_layer_error.py DIR... [--abstopk 0.25] [--windows 2] [--oracle] [--json out.json]

Inputs: the dense SmolLM2's FFN inputs on the first `--windows` 2048-token WikiText-2 test
windows. Error of layer l: ||FFN_conv(x_l) - FFN_dense(x_l)||_F / ||FFN_dense(x_l)||_F.

`--oracle` (training-free CMoE and ExpertWeaver layers: a split of the dense FFN's neurons
whose selected experts are summed unweighted): every routed expert is run on every token, and
two more columns are printed per model: `oracle` (the error with the top_k experts by their
true output norm ||expert_e(x)||: what the partition allows with a router that knows the
outputs) and `hit` (the share of the oracle's experts the router also picks). Summed over all
experts the layer is the dense FFN, which the script checks on every layer before it reports.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import WIKITEXT  # noqa: E402


def oracle_outputs(mlp, x):
    """(oracle output, all-experts output [T, d], hit rate) of one MoE FFN on tokens x [T, d]:
    each routed expert's SwiGLU computed on every token."""
    import jax
    import jax.numpy as jnp

    x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    w = [getattr(mlp, n)[...].astype(jnp.float32) for n in ("expert_gate", "expert_up", "expert_down")]
    h = jax.nn.silu(jnp.einsum("td,edm->tem", x, w[0])) * jnp.einsum("td,edm->tem", x, w[1])
    every = jnp.einsum("tem,emd->ted", h, w[2])                     # [T, E, d]
    shared = mlp.shared(x).astype(jnp.float32)
    ids, _ = mlp.route(x)
    _, best = jax.lax.top_k(jnp.linalg.norm(every, axis=-1), mlp.top_k)
    oracle = shared + jnp.take_along_axis(every, best[..., None], axis=1).sum(1)
    hit = jnp.mean(jnp.sum(ids[:, :, None] == best[:, None, :], axis=(1, 2)) / mlp.top_k)
    return oracle, shared + every.sum(1), hit


def dense_targets(dense, tokens):
    """(every layer's FFN input [B, T, d], the dense FFN's output on it) of `dense` on `tokens`."""
    import jax

    _, xs = jax.jit(lambda t: dense(t, capture_ffn_inputs=True))(tokens)
    return xs, [np.asarray(layer.mlp(x)) for layer, x in zip(dense.layers, xs)]


def rel(y, y0) -> float:
    return float(np.linalg.norm(np.asarray(y).reshape(y0.shape) - y0) / np.linalg.norm(y0))


def layer_errors(model, xs, ys, layer_out=None) -> list[float]:
    """Relative error of each of `model`'s FFNs against the dense outputs `ys` on inputs `xs`."""
    import jax

    layer_out = layer_out or jax.jit(lambda m, x: m(x))
    return [rel(layer_out(layer.mlp, x), y0) for layer, x, y0 in zip(model.layers, xs, ys)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dirs", nargs="*")
    p.add_argument("--abstopk", type=float, nargs="*", default=[], help="also AbsTopk-GLU at these sparsities")
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--oracle", action="store_true",
                   help="also the error with an oracle router and the router's hit rate")
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
    xs, ys = dense_targets(dense, toks)
    table = {}
    for s in args.abstopk:
        keep = int(round((1 - s) * dense.config.intermediate_size))
        table[f"abstopk{s}"] = [rel(abstopk_glu(x, l.mlp.gate[...], l.mlp.up[...], l.mlp.down[...], keep), y0)
                                for l, x, y0 in zip(dense.layers, xs, ys)]
    # one jitted function each, reused for every layer and model (same shapes: one compile)
    layer_out, oracle = jax.jit(lambda m, x: m(x)), jax.jit(oracle_outputs)
    for d in args.dirs:
        conv = load_model(d, progress=False).model
        name = Path(d).name
        table[name] = layer_errors(conv, xs, ys, layer_out)
        if args.oracle:
            parts = [oracle(l.mlp, x) for l, x in zip(conv.layers, xs)]
            exact = max(rel(everything, y0) for (_, everything, _), y0 in zip(parts, ys))
            if exact > 1e-3:
                sys.exit(f"error: {d}: its experts do not sum to the dense FFN (relative error "
                         f"{exact:.2e}); --oracle needs a conversion that splits the FFN's neurons "
                         "(convert with --down-fit 0)")
            table[name + ":oracle"] = [rel(o, y0) for (o, _, _), y0 in zip(parts, ys)]
            table[name + ":hit"] = [float(hit) for (_, _, hit) in parts]
    names = list(table)
    width = max(14, *(len(n) + 1 for n in names))
    print("layer " + " ".join(f"{n:>{width}}" for n in names))
    for i in range(len(ys)):
        print(f"{i:5d} " + " ".join(f"{table[n][i]:{width}.4f}" for n in names))
    print("mean  " + " ".join(f"{np.mean(table[n]):{width}.4f}" for n in names))
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()

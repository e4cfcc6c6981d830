"""Each FFN of a converted model under each dispatch path, against its source's dense FFN:
where a layer of a given shape loses time, and which path the rule picks for it.

    python benchmarks/dispatch_layers.py --model out/a075 --batch 16 --tokens 512
    python benchmarks/dispatch_layers.py --model out/a075 --layers 1 15 --paths auto sort dense

The FFN inputs are the dense source model's (`manifest source_model`, or `--source`) on
`--batch` rows of `--tokens` WikiText-2 test tokens. Per layer, the source's dense FFN and
the converted layer forced onto each of `--paths` ("auto": the platform's rule,
`cmoe_jax.moe.modes`) run interleaved (`benchmarks/harness.py`); a line per layer gives
the layer's shape, the path "auto" takes and each median in ms, the last line the sums.
Shapes repeat across layers, so `--layers` picks a few.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import WIKITEXT, interleaved_times, load_average, machine_line, module_call, print_load  # noqa: E402

PATHS = ("auto", "sort", "padded", "dense")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a converted model's directory")
    p.add_argument("--source", default=None, help="its dense model (default: the manifest's source_model)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--layers", type=int, nargs="*", default=None, help="default: every layer")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--data-path", type=Path, default=WIKITEXT / "test.txt", help="prompt text (WikiText-2 test)")
    return p.parse_args(argv)


def ffn_call(mlp, path: str):
    """`mlp(x)` jitted with its dispatch forced to `path` (the rule is read at trace time)."""
    def run(layer, x):
        if path != "auto":
            object.__setattr__(layer, "dispatch", path)
        return layer(x)
    f, leaves = module_call(mlp, run)
    return lambda x: f(leaves, x)


def main(argv=None) -> None:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cmoe_jax.data import load_text_tokens
    from cmoe_jax.loading import load_model
    from cmoe_jax.moe import MoELayer
    from cmoe_jax.moe.modes import PairCall, dispatch_mode

    load_start = load_average()
    manifest = json.loads((Path(args.model) / "cmoe_manifest.json").read_text())
    source = load_model(args.source or manifest["source_model"], progress=False)
    model = load_model(args.model, progress=False).model
    n = args.batch * args.tokens
    text = load_text_tokens("wikitext2", source.tokenizer, "test", str(args.data_path))
    tokens = jnp.asarray(np.asarray(text[:n], np.int32).reshape(args.batch, args.tokens))
    _, inputs = jax.jit(lambda t: source.model(t, capture_ffn_inputs=True))(tokens)
    print(f"# {machine_line()}; {args.model}, {args.batch} x {args.tokens} tokens")
    print("layer | shape | auto takes | dense FFN | " + " | ".join(args.paths) + "   (ms)")
    sums = np.zeros(1 + len(args.paths))
    for i in args.layers if args.layers is not None else range(len(model.layers)):
        x = inputs[i].reshape(n, -1)
        mlp = model.layers[i].mlp
        moe = isinstance(mlp, MoELayer)
        calls = [ffn_call(source.model.layers[i].mlp, "auto")]  # a kept dense layer: this alone
        calls += [ffn_call(mlp, p) for p in args.paths] if moe else []
        times = interleaved_times([lambda f=f: jax.block_until_ready(f(x)) for f in calls], args.repeats)
        ms = np.array([statistics.median(t) * 1e3 for t in times])
        ms = ms if moe else np.repeat(ms, 1 + len(args.paths))
        sums += ms
        shape = (f"S{mlp.shared_width // mlp.expert_width}A{mlp.top_k}E{mlp.num_experts + mlp.shared_width // mlp.expert_width}"
                 f" m{mlp.expert_width}") if moe else "dense"
        takes = dispatch_mode(PairCall(n * mlp.top_k, mlp.num_experts, mlp.top_k, mlp.dtype,
                                    mlp.d_model * mlp.expert_width)) if moe else "-"
        print(f"{i} | {shape} | {takes} | " + " | ".join(f"{v:.1f}" for v in ms), flush=True)
    print("sum | | | " + " | ".join(f"{v:.1f}" for v in sums))
    print_load(load_start, args.repeats, ratio=False)


if __name__ == "__main__":
    main()

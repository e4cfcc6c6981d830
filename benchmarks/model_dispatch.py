"""A converted model's forward with and without the padded dispatch: whether a path that
wins in one layer (`benchmarks/moe_grid.py`) also wins in the whole model.

    python benchmarks/model_dispatch.py --model out/s1a1e8 --tokens 128 [--dtype bfloat16]

Two jitted forwards of the same converted model over `--batch` rows of `--tokens` tokens
(the hidden states, then the LM head on the last position, as `benchmarks/prefill.py`),
both under the platform's rule (`cmoe_jax.moe.modes.DENSE_WHEN`) but one with the padded
path allowed in every layer (whatever its expert count) and one with it off. The rule is
read when a forward is traced, so each side is traced under its own rule, then the two run
interleaved (`benchmarks/harness.py`). The last line is the padded side's time over the
other's; `--data-path` gives real text (a repeated token sends every row to one expert).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import WIKITEXT, interleaved_times, load_average, machine_line, report  # noqa: E402
from benchmarks.prefill import prefill_fn  # noqa: E402

PADDED_ON = 0.8  # the share the bf16 and GPU rules use


def traced_under(rule_key: str, rule, model, tokens):
    """The prefill forward of `model`, traced (and compiled) with `DENSE_WHEN[rule_key]`
    set to `rule`."""
    import jax

    from cmoe_jax.moe import modes

    saved = modes.DENSE_WHEN.get(rule_key)
    modes.DENSE_WHEN[rule_key] = rule
    try:
        run = prefill_fn(model)
        jax.block_until_ready(run(tokens))
    finally:
        if saved is None:
            del modes.DENSE_WHEN[rule_key]
        else:
            modes.DENSE_WHEN[rule_key] = saved
    return run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a converted model's directory")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--data-path", type=Path, default=WIKITEXT / "test.txt", help="prompt text (WikiText-2 test)")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from cmoe_jax.data import load_text_tokens
    from cmoe_jax.loading.load import load_model
    from cmoe_jax.moe import modes

    load_start = load_average()
    print(f"# {machine_line()}; {args.model}, {args.batch} x {args.tokens} tokens, {args.dtype}")
    lm = load_model(args.model, dtype=jnp.dtype(args.dtype))
    model, n = lm.model, args.batch * args.tokens
    text = load_text_tokens("wikitext2", lm.tokenizer, "test", str(args.data_path))
    tokens = jnp.asarray(np.asarray(text[:n], np.int32).reshape(args.batch, args.tokens))
    backend = jax.default_backend()
    key = f"{backend}:{args.dtype}" if f"{backend}:{args.dtype}" in modes.DENSE_WHEN else backend
    rule = modes.dense_when(jnp.dtype(args.dtype))
    on = rule._replace(padded_share=rule.padded_share or PADDED_ON, padded_experts=0)
    names = ["padded on", "padded off"]
    runs = [traced_under(key, r, model, tokens) for r in (on, rule._replace(padded_share=0.0))]
    times = interleaved_times([lambda run=run: jax.block_until_ready(run(tokens)) for run in runs],
                              args.repeats)
    report(names, times, load_start)


if __name__ == "__main__":
    main()

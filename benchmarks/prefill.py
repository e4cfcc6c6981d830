"""Whole-model prefill throughput: SmolLM2 converted to S1A1E8 vs the dense model.

    python benchmarks/prefill.py [--config S1A1E8] [--batch 8] [--tokens 512] [--calib-samples 4]

Both models run the same batch (8 sequences of 512 tokens): every layer, the final norm and
the LM head on the last position, jit-compiled, the two sides interleaved (dense, MoE,
dense, ...) after a warm-up (`benchmarks/harness.py`). The MoE model is converted with the
conversion defaults (or `--router-reps/--router-neurons`) and uses the CPU grouped-matmul
path of `MoEFFN`. The last line is dense-time / MoE-time of the medians, withheld when the
load average exceeds the core count.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import interleaved_times, load_average, machine_line, report  # noqa: E402


def prefill_program(model):
    """(jitted run(state, tokens) -> the last position's logits, the model's state)."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens):
        m = nnx.merge(graphdef, state)
        return m.unembed(m.hidden_states(tokens)[:, -1:])

    return run, state


def prefill_fn(model):
    run, state = prefill_program(model)
    return lambda tokens: run(state, tokens)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--config", default="S1A1E8")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--calib-samples", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--router-reps", choices=["centroid", "energy"], default=None)
    p.add_argument("--router-neurons", type=int, default=None)
    args = p.parse_args()
    load_start = load_average()

    import jax.numpy as jnp

    from cmoe_jax.methods.cmoe import MoEPlan
    from cmoe_jax.convert import ConvertConfig, convert_model
    from cmoe_jax.data import calibration_windows, load_text_tokens
    from cmoe_jax.demo import local_wikitext
    from cmoe_jax.loading import load_model

    dense = load_model(args.model, progress=False)
    data = local_wikitext()
    tokens = load_text_tokens("wikitext2", dense.tokenizer, "validation",
                              str(data / "valid.txt") if data else None)
    calib = calibration_windows(tokens, args.calib_samples, 2048, seed=0)
    options = {k: v for k, v in (("router_reps", args.router_reps),
                                  ("router_neurons", args.router_neurons)) if v is not None}
    cc = ConvertConfig(plan=MoEPlan.parse(args.config), **options)
    moe, _ = convert_model(dense.model, calib, cc, progress=False)
    batch = jnp.asarray(calibration_windows(tokens, args.batch, args.tokens, seed=1))
    run_dense, run_moe = prefill_fn(dense.model), prefill_fn(moe)
    times = interleaved_times([lambda: run_dense(batch).block_until_ready(),
                               lambda: run_moe(batch).block_until_ready()], args.repeats)
    print(machine_line())
    print(f"prefill batch {args.batch}x{args.tokens}, {args.config} router: "
          f"{cc.router_neurons} neurons per expert by {cc.router_reps}")
    report(["dense", args.config], times, load_start, work=args.batch * args.tokens)


if __name__ == "__main__":
    main()

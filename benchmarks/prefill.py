"""Whole-model prefill throughput: SmolLM2 converted to S1A1E8 vs the dense model.

    python benchmarks/prefill.py [--config S1A1E8] [--batch 8] [--tokens 512] [--calib-samples 4]

Both models run the same batch (8 sequences of 512 tokens): every layer, the final norm and
the LM head on the last position, jit-compiled, median of several runs in one process. The
MoE model uses the CPU grouped-matmul path of `MoEFFN`. The last line is dense-time /
MoE-time as `N.NNx`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def prefill_fn(model):
    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens):
        m = nnx.merge(graphdef, state)
        return m.unembed(m.hidden_states(tokens)[:, -1:])

    return lambda tokens: run(state, tokens)


def median_time(fn, tokens, repeats):
    fn(tokens).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(tokens).block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--config", default="S1A1E8")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--calib-samples", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    import jax.numpy as jnp
    import numpy as np

    from cmoe_jax.carving import MoEPlan
    from cmoe_jax.convert import ConvertConfig, convert_model
    from cmoe_jax.data import calibration_windows, load_text_tokens
    from cmoe_jax.demo import local_wikitext
    from cmoe_jax.loading import load_model

    dense = load_model(args.model, progress=False)
    data = local_wikitext()
    tokens = load_text_tokens("wikitext2", dense.tokenizer, "validation",
                              str(data / "valid.txt") if data else None)
    calib = calibration_windows(tokens, args.calib_samples, 2048, seed=0)
    moe, _ = convert_model(dense.model, calib, ConvertConfig(plan=MoEPlan.parse(args.config)),
                           progress=False)
    batch = jnp.asarray(calibration_windows(tokens, args.batch, args.tokens, seed=1))
    t_dense = median_time(prefill_fn(dense.model), batch, args.repeats)
    t_moe = median_time(prefill_fn(moe), batch, args.repeats)
    n = args.batch * args.tokens
    print(f"dense: {t_dense:.3f} s  {n / t_dense:8.0f} tokens/s")
    print(f"{args.config}: {t_moe:.3f} s  {n / t_moe:8.0f} tokens/s")
    print(f"prefill {args.config} batch {args.batch}x{args.tokens}: {t_dense / t_moe:.2f}x")


if __name__ == "__main__":
    main()

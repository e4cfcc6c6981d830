"""Whole-model prefill and decoding speed of a real model's conversions against its dense form,
on the model's own shapes (for the 1.5B model of the scale study; any named model works).

    python benchmarks/scale_speed.py --model qwen2.5-coder-1.5b --plans S1A1E8 S3A3E8 \
        [--prefill-len 2048] [--batches 1 16] [--prompt-len 128] [--new-tokens 32] [--repeats 3]

The dense model is loaded once. For each plan in turn, the model is converted in this process
with the conversion's defaults from `--calib-windows` WikiText-2 validation windows of
`--calib-len` tokens (speed depends on the plan's shapes, not on how well the calibration
chose the experts, so one window is enough here and keeps the 1.5B model's conversion short),
then the dense and converted sides run interleaved after a compiling warm-up
(`benchmarks/harness.py`), and the converted model is dropped before the next plan, so at
most the dense model and one conversion are held at once. The work: prefill, one
`--prefill-len`-token WikiText-2 test window through every layer, the final norm and the LM
head on the last position; decode, `--new-tokens` greedy tokens after a `--prompt-len`-token
prompt (KV cache, no early stop), at each of `--batches`. `--keep DIR` saves each
conversion there, and a later run with the same DIR reads it instead of converting again. Each block prints both sides'
median and min; the output ends with

    ratio S1A1E8/dense prefill batch=1: N.NNx      (dense time / converted time)
    ratio S1A1E8/dense decode batch=1: N.NNx

withheld when the load average at the block's start exceeds the core count.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.decode import ours_side  # noqa: E402
from benchmarks.harness import (WIKITEXT, interleaved_times, machine_busy, machine_line,  # noqa: E402
                                settled_load)
from benchmarks.prefill import prefill_fn  # noqa: E402


def work(model, what: str, prompts: np.ndarray, new_tokens: int):
    """A zero-argument callable running `what` on `prompts` that blocks until it is done."""
    import jax

    if what == "decode":
        return ours_side(model, prompts, new_tokens)
    run = prefill_fn(model)
    return lambda: jax.block_until_ready(run(prompts))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--plans", nargs="+", default=["S1A1E8", "S3A3E8"])
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="decode batches")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--calib-windows", type=int, default=1)
    p.add_argument("--calib-len", type=int, default=2048)
    p.add_argument("--parts", nargs="+", choices=["prefill", "decode"], default=["prefill", "decode"])
    p.add_argument("--keep", type=Path, help="save each conversion in DIR/PLAN, or read it from there when "
                                             "a previous run saved it (a second run then times the same models)")
    args = p.parse_args(argv)

    from cmoe_jax.checkpoint import save_converted
    from cmoe_jax.convert import ConvertConfig, convert_model
    from cmoe_jax.data import load_text_tokens, text_windows
    from cmoe_jax.loading import load_model
    from cmoe_jax.methods.cmoe import MoEPlan

    began = time.perf_counter()
    lm = load_model(args.model, progress=False)
    print(f"{machine_line()}\nmodel {args.model} loaded in {time.perf_counter() - began:.1f} s", flush=True)
    valid = load_text_tokens("wikitext2", lm.tokenizer, "validation", str(WIKITEXT / "valid.txt"))
    test = load_text_tokens("wikitext2", lm.tokenizer, "test", str(WIKITEXT / "test.txt"))
    calib = text_windows(valid, args.calib_len, args.calib_windows, name="wikitext2 (valid)")
    window = np.asarray(test[:args.prefill_len], np.int32)[None]
    pool = np.asarray(test[:max(args.batches) * args.prompt_len], np.int32).reshape(max(args.batches), -1)
    blocks = [("prefill", 1, window)] * ("prefill" in args.parts) + \
        [("decode", b, pool[:b]) for b in args.batches if "decode" in args.parts]
    ratios = []
    for plan in args.plans:
        began = time.perf_counter()
        kept = args.keep / plan if args.keep else None
        if kept is not None and kept.exists():
            moe = load_model(str(kept), progress=False).model
            print(f"{plan}: read from {kept} in {time.perf_counter() - began:.1f} s", flush=True)
        else:
            moe = convert_model(lm.model, calib, ConvertConfig(plan=MoEPlan.parse(plan)), progress=False)[0]
            print(f"{plan}: converted from {args.calib_windows}x{args.calib_len} tokens in "
                  f"{time.perf_counter() - began:.1f} s", flush=True)
            if kept is not None:
                save_converted(moe, {"source_model": args.model, "config": plan}, kept, lm.tokenizer)
        for what, batch, prompts in blocks:
            load = settled_load()
            times = interleaved_times([work(lm.model, what, prompts, args.new_tokens),
                                       work(moe, what, prompts, args.new_tokens)], args.repeats)
            med = [statistics.median(ts) for ts in times]
            for name, m, ts in zip(("dense", plan), med, times):
                print(f"{what:7s} batch={batch:<3d} {name:8s} median {m:8.3f} s  min {min(ts):8.3f} s",
                      flush=True)
            value = "withheld (machine busy)" if machine_busy(load) else f"{med[0] / med[1]:.2f}x"
            ratios.append(f"ratio {plan}/dense {what} batch={batch}: {value}  (load {load:.2f} at start)")
            print(ratios[-1], flush=True)
        del moe
        gc.collect()
    print("\n".join(ratios))


if __name__ == "__main__":
    main()

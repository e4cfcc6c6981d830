"""Decoding tokens/s: dense vs CMoE-converted models (KV cache), and transformers' `generate`.

    python benchmarks/decode.py [--model smollm2] [--batches 1 16] [--prompt-len 128]
        [--new-tokens 128] [--repeats 3] [--s1a1e8 DIR] [--s3a3e8 DIR] [--plans [S1A1E8 S3A3E8]]
    python benchmarks/decode.py --shape llama2-7b --layers 4 [--dtype bfloat16]   # accelerator

Each side generates `--new-tokens` greedy tokens after a `--prompt-len`-token prompt (WikiText-2
test text) for a batch of 1 and of 16 prompts, no early stop; the time covers the prefill and
every step, and tokens/s = batch x new tokens / time. Sides: cmoe_jax's dense model, its
S1A1E8 and S3A3E8 conversions (converted here from a few WikiText-2 validation windows, or read
from `--s1a1e8/--s3a3e8` directories), and `transformers` `generate` (float32, SDPA, torch's
default threads) on the same dense weights. The sides alternate after a warm-up that compiles
(`benchmarks/harness.py`); medians are compared. The output ends with each converted model's
and the dense model's ratios at each batch,

    ratio S1A1E8/dense batch=1: N.NNx   (... S3A3E8/dense, and batch=16)
    ratio dense/transformers batch=1: N.NNx

(tokens/s over tokens/s), withheld with the harness's warning when the load average at start
exceeds the core count. `--plans` names the conversions timed (none: dense against
`transformers` alone, which holds two copies of a large model instead of four). `--shape llama2-7b --layers N`: random weights of that shape cut to N
layers, converted from random calibration tokens, no transformers side (an accelerator host).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import WIKITEXT, interleaved_times, load_average, machine_busy, machine_line, print_load  # noqa: E402

SHAPES = {"llama2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                            num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, activation="silu", rms_norm_eps=1e-5,
                            max_position_embeddings=4096),
          # a smoke test of the random-weight mode on any machine
          "tiny": dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=256,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, activation="silu", max_position_embeddings=1024)}
PLANS = ("S1A1E8", "S3A3E8")


def smollm2_models(args, lm, tokens_valid):
    """({plan: converted Decoder}, the torch model of the same weights)."""
    from cmoe_jax.methods.cmoe import MoEPlan
    from cmoe_jax.convert import ConvertConfig, convert_model
    from cmoe_jax.data import text_windows
    from cmoe_jax.loading import load_model, resolve

    converted = {}
    for plan, given in zip(PLANS, (args.s1a1e8, args.s3a3e8)):
        if plan not in args.plans:
            continue
        if given:
            converted[plan] = load_model(given, progress=False).model
        else:
            calib = text_windows(tokens_valid, 512, args.calib_windows, name="wikitext2 (valid)")
            converted[plan] = convert_model(lm.model, calib, ConvertConfig(plan=MoEPlan.parse(plan)),
                                            progress=False)[0]
    from benchmarks.torch_reference import load_torch_causal_lm

    return converted, load_torch_causal_lm(resolve(args.model)).eval()


def random_models(args):
    import jax.numpy as jnp
    from flax import nnx

    from cmoe_jax.methods.cmoe import MoEPlan
    from cmoe_jax.convert import ConvertConfig, convert_model
    from cmoe_jax.models import Decoder, ModelConfig

    shape = dict(SHAPES[args.shape], num_layers=args.layers or SHAPES[args.shape]["num_layers"])
    cfg = ModelConfig(**shape)
    dense = Decoder(cfg, dtype=getattr(jnp, args.dtype), rngs=nnx.Rngs(0))
    calib = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.calib_windows, 512)).astype(np.int32)
    converted = {plan: convert_model(dense, calib, ConvertConfig(plan=MoEPlan.parse(plan)), progress=False)[0]
                 for plan in args.plans}
    return dense, converted


def torch_side(model, prompts, new_tokens):
    import torch

    ids = torch.as_tensor(prompts, dtype=torch.long)
    model.generation_config.eos_token_id = None

    def run():
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return run


def ours_side(model, prompts, new_tokens):
    from cmoe_jax.generate import Decoding, generate

    rows = [list(map(int, p)) for p in prompts]
    return lambda: generate(model, rows, Decoding(new_tokens, batch_size=len(rows)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--calib-windows", type=int, default=4, help="calibration windows of 512 tokens")
    p.add_argument("--s1a1e8", help="converted S1A1E8 model directory (default: convert here)")
    p.add_argument("--s3a3e8", help="converted S3A3E8 model directory (default: convert here)")
    p.add_argument("--plans", nargs="*", choices=PLANS, default=list(PLANS),
                   help="the conversions timed (none: dense against transformers only)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="random weights of this shape instead")
    p.add_argument("--layers", type=int, help="--shape: keep only this many layers")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="--shape: dtype")
    args = p.parse_args(argv)
    load_start = load_average()


    if args.shape:
        dense, converted = random_models(args)
        torch_model, vocab = None, dense.config.vocab_size
        prompt_pool = np.random.default_rng(1).integers(0, vocab, (max(args.batches), args.prompt_len))
    else:
        from cmoe_jax.data import load_text_tokens
        from cmoe_jax.loading import load_model

        lm = load_model(args.model, progress=False)
        valid = load_text_tokens("wikitext2", lm.tokenizer, "validation", str(WIKITEXT / "valid.txt"))
        test = load_text_tokens("wikitext2", lm.tokenizer, "test", str(WIKITEXT / "test.txt"))
        converted, torch_model = smollm2_models(args, lm, valid)
        dense = lm.model
        n = max(args.batches) * args.prompt_len
        prompt_pool = test[:n].reshape(max(args.batches), args.prompt_len)
    torch_info = "no transformers side"
    if torch_model is not None:
        import torch

        torch_info = f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    print(f"{machine_line()}; {torch_info}")
    print(f"model: {args.shape or args.model}; prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, "
          f"greedy, batches {args.batches}")
    medians = {}
    for batch in args.batches:
        prompts = prompt_pool[:batch]
        names = ["dense", *converted] + (["transformers"] if torch_model is not None else [])
        sides = [ours_side(dense, prompts, args.new_tokens),
                 *(ours_side(m, prompts, args.new_tokens) for m in converted.values())]
        if torch_model is not None:
            sides.append(torch_side(torch_model, prompts, args.new_tokens))
        times = interleaved_times(sides, args.repeats)
        for name, ts in zip(names, times):
            medians[name, batch] = statistics.median(ts)
            print(f"batch={batch:<3d} {name:13s} median {medians[name, batch]:8.3f} s  min {min(ts):8.3f} s"
                  f"  {batch * args.new_tokens / medians[name, batch]:9.1f} tokens/s")
    busy = print_load(load_start, args.repeats)
    pairs = [(name, "dense") for name in converted] + ([("dense", "transformers")] if torch_model is not None else [])
    for a, ref in pairs:
        for b in args.batches:
            value = "withheld (machine busy)" if busy or machine_busy(load_start) else \
                f"{medians[ref, b] / medians[a, b]:.2f}x"
            print(f"ratio {a}/{ref} batch={b}: {value}")


if __name__ == "__main__":
    main()

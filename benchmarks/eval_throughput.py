"""Perplexity tokens/s of cmoe_jax against `transformers` (torch) on the same windows.

    python benchmarks/eval_throughput.py [--model smollm2] [--windows 4] [--seqlen 2048]

Both evaluate the same WikiText-2 test windows of the same weights (the GGUF read by
`transformers` itself, fp32, SDPA attention, batch 1) in one run. Prints both perplexities,
their relative difference, and last the throughput ratio `ratio: N.NNx` (JAX / torch).
With --windows 40 this is also the README's dense-perplexity parity check.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def torch_reference(path: Path):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    kw = dict(torch_dtype=torch.float32, attn_implementation="sdpa")
    if path.suffix == ".gguf":
        return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), **kw).eval()


def torch_perplexity(model, windows: np.ndarray) -> dict:
    import torch

    total, seconds, counted = 0.0, 0.0, 0
    with torch.inference_mode():
        for i, w in enumerate(windows):
            x = torch.tensor(w[None], dtype=torch.long)
            t0 = time.perf_counter()
            logits = model(x).logits[0, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
            if i > 0 or len(windows) == 1:  # same warm-up exclusion as the JAX side
                seconds += time.perf_counter() - t0
                counted += len(w) - 1
            total += nll
    tokens = len(windows) * (windows.shape[1] - 1)
    return {"ppl": math.exp(total / tokens), "tokens_per_s": counted / seconds}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--data-path", default=None)
    args = p.parse_args()

    from cmoe_jax.data import load_text_tokens, text_windows
    from cmoe_jax.demo import local_wikitext
    from cmoe_jax.eval import perplexity
    from cmoe_jax.loading import load_model, resolve

    data = args.data_path or (str(local_wikitext() / "test.txt") if local_wikitext() else None)
    lm = load_model(args.model, progress=False)
    windows = text_windows(load_text_tokens("wikitext2", lm.tokenizer, "test", data), args.seqlen, args.windows)
    ours = perplexity(lm.model, windows, batch_size=1, progress=False)
    del lm
    ref = torch_perplexity(torch_reference(resolve(args.model)), windows)
    rel = abs(ours["ppl"] - ref["ppl"]) / ref["ppl"]
    print(f"windows: {len(windows)} x {args.seqlen}")
    print(f"cmoe_jax     ppl {ours['ppl']:.4f}  {ours['tokens_per_s']:8.1f} tokens/s")
    print(f"transformers ppl {ref['ppl']:.4f}  {ref['tokens_per_s']:8.1f} tokens/s")
    print(f"ppl relative difference: {100 * rel:.4f}%")
    print(f"ratio: {ours['tokens_per_s'] / ref['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()

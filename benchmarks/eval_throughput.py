"""Perplexity tokens/s of cmoe_jax against `transformers` (torch) on the same windows.

    python benchmarks/eval_throughput.py [--model smollm2] [--windows 4] [--seqlen 2048] [--repeats 1]

Both sides evaluate the same WikiText-2 test windows (../shared/data/wikitext-2/test.txt
when present, else --data-path or `datasets`) with the same weights (for a GGUF, the file
read by `transformers` itself), in float32, batch 1, in one process:

- cmoe_jax: `cmoe_jax.eval.perplexity` (jit-compiled step, chunked float32 log-softmax);
  its tokens/s covers every window and leaves the one-off compilation out.
- transformers: `AutoModelForCausalLM`, SDPA attention, `torch.inference_mode`, torch's
  default thread count; cross-entropy of logits[:-1] against tokens[1:] summed per window.
  One untimed warm-up window first, then every window is timed.

With --repeats R the two alternate R times and the best tokens/s of each is kept (the
machine may be shared). Prints both perplexities, their relative difference, and last the
throughput ratio `ratio: N.NNx` (cmoe_jax / transformers; above 1 means cmoe_jax is faster).
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torch_reference import load_torch_causal_lm  # noqa: E402  (benchmarks/ is on sys.path)


def local_wikitext_test() -> str | None:
    f = ROOT.parent / "shared" / "data" / "wikitext-2" / "test.txt"
    return str(f) if f.exists() else None


def torch_reference(path: Path):
    return load_torch_causal_lm(path).eval()


def torch_perplexity(model, windows: np.ndarray) -> dict:
    import torch

    def window_nll(w) -> float:
        x = torch.from_numpy(w[None].astype(np.int64))
        logits = model(x).logits[0, :-1].float()
        return torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()

    with torch.inference_mode():
        window_nll(windows[0])  # warm-up, untimed
        t0 = time.perf_counter()
        total = sum(window_nll(w) for w in windows)
        seconds = time.perf_counter() - t0
    tokens = windows.shape[0] * (windows.shape[1] - 1)
    return {"ppl": math.exp(total / tokens), "tokens_per_s": tokens / seconds, "seconds": seconds}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--data-path", default=None, help="WikiText-2 test file (default: the shared copy)")
    args = p.parse_args(argv)

    import jax
    import torch

    from cmoe_jax.data import load_text_tokens, text_windows
    from cmoe_jax.eval import perplexity
    from cmoe_jax.loading import load_model, resolve

    data = args.data_path or local_wikitext_test()
    lm = load_model(args.model, progress=False)
    windows = text_windows(load_text_tokens("wikitext2", lm.tokenizer, "test", data), args.seqlen,
                           args.windows, name="wikitext2 (test)")
    ref_model = torch_reference(resolve(args.model))
    ours, ref = [], []
    for _ in range(args.repeats):
        ours.append(perplexity(lm.model, windows, batch_size=1, progress=False))
        ref.append(torch_perplexity(ref_model, windows))
    best_ours = max(r["tokens_per_s"] for r in ours)
    best_ref = max(r["tokens_per_s"] for r in ref)
    rel = abs(ours[0]["ppl"] - ref[0]["ppl"]) / ref[0]["ppl"]
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
          f"jax {jax.__version__} on {jax.devices()[0].platform} x{len(jax.devices())}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"model: {args.model}; data: {data or 'datasets'}; windows: {len(windows)} x {args.seqlen}; "
          f"repeats: {args.repeats}")
    print(f"cmoe_jax     ppl {ours[0]['ppl']:.4f}  {best_ours:8.1f} tokens/s "
          f"(compile {ours[0]['compile_seconds']:.1f} s, not counted)")
    print(f"transformers ppl {ref[0]['ppl']:.4f}  {best_ref:8.1f} tokens/s")
    print(f"ppl relative difference: {100 * rel:.4f}%")
    print(f"ratio: {best_ours / best_ref:.2f}x")


if __name__ == "__main__":
    main()

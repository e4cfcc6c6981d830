"""Perplexity tokens/s of cmoe_jax against `transformers` (torch) on the same windows.

    python benchmarks/eval_throughput.py [--model smollm2] [--windows 4] [--seqlen 2048] [--repeats 3]

Both sides evaluate the same WikiText-2 test windows (../shared/data/wikitext-2/test.txt
when present, else --data-path or `datasets`) with the same weights (for a GGUF, the file
read by `transformers` itself), in float32, batch 1, in one process:

- cmoe_jax: `cmoe_jax.eval.perplexity` (jit-compiled step, chunked float32 log-softmax),
  compiled in the untimed warm-up pass.
- transformers: `AutoModelForCausalLM`, SDPA attention, `torch.inference_mode`, torch's
  default thread count; cross-entropy of logits[:-1] against tokens[1:] summed per window.

After one untimed warm-up pass each, the two alternate (transformers, cmoe_jax, ...)
--repeats times over every window (`benchmarks/harness.py`). Prints both perplexities and
their relative difference, then median and min per side, the load average at start and end,
and last `ratio (...): N.NNx` = transformers time / cmoe_jax time of the medians (above 1:
cmoe_jax is faster), withheld when the load average exceeds the core count.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import WIKITEXT, interleaved_times, load_average, machine_line, report  # noqa: E402
from benchmarks.torch_reference import load_torch_causal_lm  # noqa: E402


def local_wikitext_test() -> str | None:
    f = WIKITEXT / "test.txt"
    return str(f) if f.exists() else None


def torch_reference(path: Path):
    return load_torch_causal_lm(path).eval()


def torch_perplexity(model, windows: np.ndarray) -> float:
    import torch

    def window_nll(w) -> float:
        x = torch.from_numpy(w[None].astype(np.int64))
        logits = model(x).logits[0, :-1].float()
        return torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()

    with torch.inference_mode():
        total = sum(window_nll(w) for w in windows)
    return math.exp(total / (windows.shape[0] * (windows.shape[1] - 1)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each side")
    p.add_argument("--data-path", default=None, help="WikiText-2 test file (default: the shared copy)")
    args = p.parse_args(argv)
    load_start = load_average()

    import torch

    from cmoe_jax.data import load_text_tokens, text_windows
    from cmoe_jax.eval import perplexity
    from cmoe_jax.loading import load_model, resolve

    data = args.data_path or local_wikitext_test()
    lm = load_model(args.model, progress=False)
    windows = text_windows(load_text_tokens("wikitext2", lm.tokenizer, "test", data), args.seqlen,
                           args.windows, name="wikitext2 (test)")
    ref_model = torch_reference(resolve(args.model))
    ppl = {}
    sides = [lambda: ppl.__setitem__("transformers", torch_perplexity(ref_model, windows)),
             lambda: ppl.__setitem__("cmoe_jax", perplexity(lm.model, windows, batch_size=1,
                                                            progress=False))]
    times = interleaved_times(sides, args.repeats)  # the warm-up pass compiles cmoe_jax's step
    ours, theirs = ppl["cmoe_jax"]["ppl"], ppl["transformers"]
    print(f"{machine_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"model: {args.model}; data: {data or 'datasets'}; windows: {len(windows)} x {args.seqlen}")
    print(f"ppl: cmoe_jax {ours:.4f}, transformers {theirs:.4f}, relative difference "
          f"{100 * abs(ours - theirs) / theirs:.4f}%")
    report(["transformers", "cmoe_jax"], times, load_start, work=windows.shape[0] * (windows.shape[1] - 1))


if __name__ == "__main__":
    main()

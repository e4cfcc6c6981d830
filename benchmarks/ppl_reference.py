"""Perplexity of `transformers` reading the same file, on the windows `cmoe-jax eval` scores.

    python benchmarks/ppl_reference.py --model gemma3-270m --data-path wiki.test.raw --max-windows 40

The reference side of a perplexity figure: the windows come from our own pipeline
(`load_text_tokens` + `eval_windows`, with the family's BOS convention), the model is
`AutoModelForCausalLM` (float32, SDPA) reading the same HF directory or GGUF file, and each
window's mean next-token NLL is averaged. Prints the per-window NLL and `ppl N`; `--json`
writes them. Needs the `reference` extra (torch).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.torch_reference import load_torch_causal_lm  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--data-path", required=True)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--max-windows", type=int, default=40)
    p.add_argument("--json")
    args = p.parse_args(argv)

    import torch

    from cmoe_jax.data import eval_windows, load_text_tokens
    from cmoe_jax.jobs.source import SourceModel
    from cmoe_jax.loading import window_bos

    source = SourceModel(args.model)
    tokens = load_text_tokens("wikitext2", source.tokenizer, split="test", data_path=args.data_path)
    windows = eval_windows(tokens, "wikitext2", args.seqlen, args.max_windows,
                           bos=window_bos(source.config, source.tokenizer))
    model = load_torch_causal_lm(Path(source.path)).eval()
    nlls = []
    with torch.no_grad():
        for i, w in enumerate(windows):
            ids = torch.tensor(w[None].astype("int64"))
            nlls.append(float(model(ids, labels=ids).loss))
            print(f"window {i}: nll {nlls[-1]:.6f}", flush=True)
    nll = sum(nlls) / len(nlls)
    result = {"model": args.model, "windows": len(nlls), "nll": nll, "ppl": math.exp(nll),
              "window_nll": nlls}
    print(f"ppl {result['ppl']:.6f} (mean NLL {nll:.6f}, {len(nlls)} windows)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

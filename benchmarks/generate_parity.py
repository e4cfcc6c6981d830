"""Greedy generation of a real model against `transformers` `generate` reading the same file.

    python benchmarks/generate_parity.py --model qwen2.5-coder-1.5b --data-path wiki.test.raw \
        [--prompts 4] [--prompt-len 64] [--new-tokens 32] [--json out.json]

The prompts are the first `--prompts` stretches of `--prompt-len` tokens of the WikiText-2 test
text (our tokenizer, no BOS), decoded greedily for `--new-tokens` tokens, no early stop, one
batch: cmoe_jax's `generate` (float32, KV cache), then the model dropped, then
`AutoModelForCausalLM` (float32, SDPA) with `do_sample=False`. Prints per prompt whether the
continuations are equal and where they first differ. Needs the `reference` extra (torch).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.torch_reference import load_torch_causal_lm  # noqa: E402


def transformers_greedy(path: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    import torch

    hf = load_torch_causal_lm(path)
    hf.generation_config.eos_token_id = None
    ids = torch.tensor(prompts, dtype=torch.long)  # equal lengths: no padding
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--data-path", required=True)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    import jax

    from cmoe_jax.data import load_text_tokens
    from cmoe_jax.generate import Decoding, generate
    from cmoe_jax.loading import load_model

    lm = load_model(args.model, progress=False)
    tokens = load_text_tokens("wikitext2", lm.tokenizer, split="test", data_path=args.data_path)
    prompts = [tokens[i * args.prompt_len:(i + 1) * args.prompt_len].tolist() for i in range(args.prompts)]
    began = time.perf_counter()
    ours = generate(lm.model, prompts, Decoding(args.new_tokens, batch_size=len(prompts)))
    ours_s = time.perf_counter() - began
    path = lm.path
    del lm
    gc.collect()
    jax.clear_caches()
    began = time.perf_counter()
    ref = transformers_greedy(path, prompts, args.new_tokens)
    ref_s = time.perf_counter() - began
    rows = []
    for i, (a, b) in enumerate(zip(ours, ref)):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        rows.append({"prompt": i, "equal": a == b, "first_difference": first, "ours": a, "transformers": b})
        print(f"prompt {i}: {'equal' if a == b else f'differs from token {first}'}")
    print(f"{sum(r['equal'] for r in rows)} of {len(rows)} continuations equal "
          f"({args.new_tokens} greedy tokens each; ours {ours_s:.0f} s, transformers {ref_s:.0f} s "
          "with loading)")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "date": time.strftime("%Y-%m-%d"),
                                         "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

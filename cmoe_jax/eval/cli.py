"""`python -m cmoe_jax.eval`: perplexity of a dense or converted model on WikiText-2 or C4."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from cmoe_jax.errors import CmoeError


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m cmoe_jax.eval", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="HF dir, Hub id, .gguf, converted model dir, or 'smollm2'")
    p.add_argument("--dataset", default="wikitext2", choices=["wikitext2", "c4"])
    p.add_argument("--data-path", help="local text file instead of downloading the dataset")
    p.add_argument("--split", default=None, help="dataset split (default: test for WikiText-2, validation for C4)")
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None, help="windows per step (default: one per device)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--json", help="write the result here")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def run(args) -> dict:
    import jax.numpy as jnp

    from cmoe_jax.data import C4_WINDOWS, load_text_tokens, text_windows
    from cmoe_jax.eval.perplexity import perplexity
    from cmoe_jax.loading import load_config, load_model, load_tokenizer

    if args.seqlen < 2:
        raise CmoeError(f"--seqlen must be at least 2, got {args.seqlen}")
    if args.json and not Path(args.json).resolve().parent.exists():
        raise CmoeError(f"--json: directory {Path(args.json).parent} does not exist")
    cfg, path = load_config(args.model)  # cheap: validates path, architecture, context
    if args.seqlen > cfg.max_position_embeddings:
        raise CmoeError(f"--seqlen {args.seqlen} exceeds the model's context of "
                        f"{cfg.max_position_embeddings} tokens")
    tok_path = path / "tokenizer" if (path / "tokenizer").is_dir() else path
    tokenizer = load_tokenizer(tok_path)
    if tokenizer is None:
        raise CmoeError(f"{path} has no tokenizer (tokenizer.json / tokenizer.model)")
    split = args.split or ("test" if args.dataset == "wikitext2" else "validation")
    tokens = load_text_tokens(args.dataset, tokenizer, split=split, data_path=args.data_path)
    cap = args.max_windows if args.dataset == "wikitext2" else min(args.max_windows or C4_WINDOWS, C4_WINDOWS)
    windows = text_windows(tokens, args.seqlen, cap, name=f"{args.dataset} ({split})")
    lm = load_model(args.model, dtype=getattr(jnp, args.dtype), progress=not args.no_progress)
    result = perplexity(lm.model, windows, batch_size=args.batch_size, progress=not args.no_progress)
    return {"model": args.model, "dataset": args.dataset, "split": split, "data_path": args.data_path,
            "seqlen": args.seqlen, "dtype": args.dtype, **result}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except (CmoeError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{result['dataset']} perplexity {result['ppl']:.4f} over {result['windows']} windows "
          f"({result['tokens']} tokens, {result['tokens_per_s']:.0f} tokens/s on {result['devices']} device(s))")
    if args.json:
        tmp = Path(args.json).with_name(Path(args.json).name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, args.json)
    return 0

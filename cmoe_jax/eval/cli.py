"""`python -m cmoe_jax.eval`: perplexity of a dense or converted model on WikiText-2 or C4.

Arguments, data and the model's context are checked before any weight is loaded; a bad
input prints one `error: ...` line on stderr and exits with status 2 without writing
anything. The --json file is written only at the end (temporary file + rename).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from cmoe_jax.errors import CmoeError, run_job


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cmoe_jax.eval",
        description="Perplexity (GPTQ convention: non-overlapping windows, mean NLL of tokens[1:]) "
                    "of a dense or converted model on WikiText-2 or C4, data-parallel over all devices.",
        epilog="example: python -m cmoe_jax.eval --model smollm2 --dataset wikitext2 "
               "--data-path ../shared/data/wikitext-2/test.txt --max-windows 40 --json ppl.json. "
               "Bad input exits with status 2 and one 'error: ...' line.")
    p.add_argument("--model", default="smollm2",
                   help="Hugging Face checkpoint dir, Hub id, .gguf file, converted cmoe_jax model dir, "
                        "or 'smollm2' (the embedded SmolLM2-135M-Instruct; default)")
    p.add_argument("--dataset", default="wikitext2", choices=["wikitext2", "c4"])
    p.add_argument("--data-path", help="local text file instead of downloading the dataset "
                                       "(WikiText-2: a release file; C4: JSON lines or one document per line)")
    p.add_argument("--source", default="auto", choices=["auto", "file", "datasets", "tfds"],
                   help="where the text comes from (auto: --data-path if given, else datasets, else tfds)")
    p.add_argument("--split", default=None, help="dataset split (default: test for WikiText-2, validation for C4)")
    p.add_argument("--seqlen", type=int, default=2048, help="tokens per window (default 2048)")
    p.add_argument("--max-windows", type=int, default=None, help="evaluate only the first N windows")
    p.add_argument("--batch-size", type=int, default=None,
                   help="windows per step, rounded up to a multiple of the device count (default: one per device)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter dtype")
    p.add_argument("--json", help="write the result as JSON to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def _validate_args(args) -> None:
    if args.seqlen < 2:
        raise CmoeError(f"--seqlen must be at least 2, got {args.seqlen}")
    if args.max_windows is not None and args.max_windows < 1:
        raise CmoeError(f"--max-windows must be at least 1, got {args.max_windows}")
    if args.batch_size is not None and args.batch_size < 1:
        raise CmoeError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.json:
        parent = Path(args.json).expanduser().resolve().parent
        if not parent.is_dir():
            raise CmoeError(f"--json: directory {parent} does not exist")


def run(args) -> dict:
    """Evaluate; raises CmoeError / ValueError / OSError on bad input."""
    _validate_args(args)
    import jax
    import jax.numpy as jnp

    from cmoe_jax.data import default_split, eval_windows, load_text_tokens
    from cmoe_jax.eval.perplexity import perplexity
    from cmoe_jax.loading import load_config, load_model, load_tokenizer

    cfg, path = load_config(args.model)  # cheap: validates the path, architecture and context
    if args.seqlen > cfg.max_position_embeddings:
        raise CmoeError(f"--seqlen {args.seqlen} exceeds the model's context of "
                        f"{cfg.max_position_embeddings} tokens: use --seqlen {cfg.max_position_embeddings} or less")
    tok_path = path / "tokenizer" if path.is_dir() and (path / "tokenizer").is_dir() else path
    tokenizer = load_tokenizer(tok_path)
    if tokenizer is None:
        raise CmoeError(f"{path} has no tokenizer (tokenizer.json / tokenizer.model): "
                        "copy the source model's tokenizer files next to its weights")
    split = args.split or default_split(args.dataset)
    tokens = load_text_tokens(args.dataset, tokenizer, split=split, data_path=args.data_path,
                              source=args.source)
    windows = eval_windows(tokens, args.dataset, args.seqlen, args.max_windows,
                           name=f"{args.dataset} ({args.data_path or split})")
    lm = load_model(args.model, dtype=getattr(jnp, args.dtype), progress=not args.no_progress)
    result = perplexity(lm.model, windows, batch_size=args.batch_size, progress=not args.no_progress)
    return {"model": args.model, "dataset": args.dataset, "split": split, "data_path": args.data_path,
            "seqlen": args.seqlen, "dtype": args.dtype, "platform": jax.devices()[0].platform, **result}


def main(argv=None) -> int:
    args = parse_args(argv)
    result, code = run_job(run, args)
    if code:
        return code
    print(f"{result['dataset']} perplexity {result['ppl']:.4f} (mean NLL {result['nll']:.5f}) over "
          f"{result['windows']} windows x {result['seqlen']} ({result['tokens']} predicted tokens); "
          f"{result['tokens_per_s']:,.0f} tokens/s on {result['devices']} {result['platform']} device(s), "
          f"{result['seconds']:.1f} s + {result['compile_seconds']:.1f} s compile")
    if args.json:
        from cmoe_jax.checkpoint import write_json_atomic

        write_json_atomic(Path(args.json).expanduser(), result)
    return 0

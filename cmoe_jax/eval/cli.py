"""`python -m cmoe_jax.eval`: perplexity on WikiText-2 or C4, or with `--task` zero-shot
multiple-choice accuracy (lm-eval conventions), of a dense, converted or fine-tuned model.

Arguments, data and the model's context are checked before any weight is loaded; a bad
input prints one `error: ...` line on stderr and exits with status 2 without writing
anything. The --out (--json) file is written only at the end (temporary file + rename).
"""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from cmoe_jax import distributed
from cmoe_jax.atomic_files import write_json_atomic
from cmoe_jax.cli_args import (Parser, add_data, add_model, add_output_json, add_progress,
                               add_seqlen, add_windows, check_writable_file, command_main,
                               positive_int)
from cmoe_jax.data import default_split, eval_windows, load_text_tokens
from cmoe_jax.errors import CmoeError
from cmoe_jax.eval.perplexity import perplexity
from cmoe_jax.eval.tasks import TASKS, evaluate_task, get_task, load_documents
from cmoe_jax.jobs import SourceModel
from cmoe_jax.jobs.apart import check_apart, declared_inputs
from cmoe_jax.loading import window_bos

PERPLEXITY_ONLY = ("dataset", "split", "source", "seqlen", "max_windows")
DESCRIPTION = ("Perplexity (GPTQ convention: non-overlapping windows, mean NLL of tokens[1:]) of a "
               "dense or converted model on WikiText-2 or C4, or with --task its zero-shot "
               "multiple-choice accuracy (lm-evaluation-harness conventions), data-parallel over "
               "all devices. Bad input exits with status 2 and one 'error: ...' line.")
EXAMPLE = ("{prog} --model smollm2 --data-path wikitext-2/wiki.test.raw --max-windows 40 --out ppl.json\n"
           "  {prog} --model out/s3a3e8 --task arc_easy --data-path arc-easy/test.jsonl --out arc.json")


def build_parser(prog: str = "python -m cmoe_jax.eval") -> Parser:
    p = Parser(prog, DESCRIPTION, EXAMPLE.format(prog=prog))
    add_model(p)
    p.add_argument("--task", "--tasks", dest="task", metavar="TASK",
                   help=f"zero-shot multiple-choice task instead of perplexity ({', '.join(sorted(TASKS))}); "
                        "needs --data-path, the task's JSON-lines file")
    data = add_data(p, None, "perplexity")
    data.add_argument("--source", default="auto", choices=["auto", "file", "datasets", "tfds"],
                      help="where the text comes from (auto: --data-path if given, else datasets, else tfds)")
    add_windows(p, limit=True)
    add_seqlen(p, 2048)
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="windows per step (--task: sequences per step, default 32), rounded up to a "
                        "multiple of the device count (default: one per device)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter dtype")
    add_output_json(p)
    add_progress(p)
    return p


def parse_args(argv=None, prog: str = "python -m cmoe_jax.eval"):
    p = build_parser(prog)
    args = p.parse_args(argv)
    if args.task:
        p.reject(args, PERPLEXITY_ONLY, "to --task (they choose perplexity windows)")
    else:
        p.reject(args, ("limit",), "without --task (use --max-windows for perplexity)")
    return args


def _validate_args(args) -> None:
    check_apart({"--out": args.out}, {"the model": args.model, **declared_inputs(args)})
    # process 0 alone writes the JSON, so it alone tries the path
    distributed.on_main(lambda: check_writable_file(args.out, "--out"))


def run(args) -> dict:
    """Evaluate; raises CmoeError on bad input."""

    distributed.initialize()  # a multi-process job splits the windows / questions
    _validate_args(args)
    if args.task:
        return run_task(args)


    source = _checked_source(args)
    cfg, tokenizer = source.config, source.tokenizer
    if args.seqlen > cfg.max_position_embeddings:
        raise CmoeError(f"--seqlen {args.seqlen} exceeds the model's context of "
                        f"{cfg.max_position_embeddings} tokens: use --seqlen {cfg.max_position_embeddings} or less")
    split = args.split or default_split(args.dataset)
    tokens = load_text_tokens(args.dataset, tokenizer, split=split, data_path=args.data_path,
                              source=args.source)
    windows = eval_windows(tokens, args.dataset, args.seqlen, args.max_windows,
                           name=f"{args.dataset} ({args.data_path or split})",
                           bos=window_bos(cfg, tokenizer))
    lm = source.load(dtype=getattr(jnp, args.dtype), progress=not args.no_progress)
    result = perplexity(lm.model, windows, batch_size=args.batch_size, progress=not args.no_progress)
    return {"model": args.model, "dataset": args.dataset, "split": split, "data_path": args.data_path,
            "seqlen": args.seqlen, "dtype": args.dtype, "platform": jax.devices()[0].platform, **result}


def _checked_source(args) -> SourceModel:
    """The model's config and tokenizer, read once for the whole job (weights later)."""
    source = SourceModel(args.model)  # cheap: validates the path, architecture and context
    if source.tokenizer is None:
        raise CmoeError(f"{source.path} has no tokenizer (tokenizer.json / tokenizer.model): "
                        "copy the source model's tokenizer files next to its weights")
    return source


def run_task(args) -> dict:
    """Zero-shot multiple-choice accuracy; task, data file and model are checked before loading."""

    task = get_task(args.task)
    if not args.data_path:
        raise CmoeError(f"--task {args.task} needs --data-path, the task's JSON-lines file "
                        "(e.g. the ARC-Easy test split as JSON lines)")
    docs = load_documents(task, args.data_path, args.limit)
    source = _checked_source(args)
    tokenizer = source.tokenizer
    lm = source.load(dtype=getattr(jnp, args.dtype), progress=not args.no_progress)
    bos = window_bos(lm.config, tokenizer)  # lm-eval's add_bos_token, per family
    encode = tokenizer.encode if bos is None else (lambda text: [bos, *tokenizer.encode(text)])
    result = evaluate_task(lm.model, encode, task, docs, batch_size=args.batch_size or 32,
                           progress=not args.no_progress)
    return {"model": args.model, "data_path": args.data_path, "limit": args.limit, "dtype": args.dtype,
            "platform": jax.devices()[0].platform, **result}


def report(args, result: dict) -> None:
    """The one-line summary, and the JSON of `--json`, on the main process."""
    if not distributed.is_main():
        return
    if args.task:
        print(f"{result['task']}: acc {result['acc']:.4f} ± {result['acc_stderr']:.4f}, acc_norm "
              f"{result['acc_norm']:.4f} ± {result['acc_norm_stderr']:.4f} over {result['items']} questions "
              f"({result['requests']} continuations); {result['items_per_s']:.2f} questions/s on "
              f"{result['devices']} {result['platform']} device(s), {result['seconds']:.1f} s "
              f"(of which {result['compile_seconds']:.1f} s first calls of {result['shapes']} shapes)")
    else:
        print(f"{result['dataset']} perplexity {result['ppl']:.4f} (mean NLL {result['nll']:.5f}) over "
              f"{result['windows']} windows x {result['seqlen']} ({result['tokens']} predicted tokens); "
              f"{result['tokens_per_s']:,.0f} tokens/s on {result['devices']} {result['platform']} device(s), "
              f"{result['seconds']:.1f} s + {result['compile_seconds']:.1f} s compile")
    if args.out:
        write_json_atomic(Path(args.out).expanduser(), result)


def main(argv=None, prog: str = "python -m cmoe_jax.eval") -> int:
    return command_main(parse_args, run, report, argv, prog)

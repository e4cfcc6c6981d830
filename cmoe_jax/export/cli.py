"""`python -m cmoe_jax.export`: write a cmoe_jax model as a Hugging Face directory.

The data flags (as `convert`'s) choose the windows on which the exported model, read back by
transformers when torch is installed, is compared with ours (`--calib-samples 0`: no check).
Logits differing by more than 1e-3 of the logits' scale (max |logit|, at least 1) fail the
export: exit 2, nothing published. `--resume` keeps only staged shards whose sha256 still
matches and only when the source model and settings are unchanged.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from cmoe_jax import distributed
from cmoe_jax.cli_args import (Parser, add_calib_samples, add_data, add_model, add_output_dir,
                               add_progress, add_seed, add_seqlen, check_writable_dir, command_main,
                               mib_size)
from cmoe_jax.export.api import ExportSettings, export

EXAMPLE = "{prog} --model out/s3a3e8 --data-path wikitext-2/wiki.valid.raw --out hf/s3a3e8"


def build_parser(prog: str = "python -m cmoe_jax.export") -> Parser:
    p = Parser(prog, __doc__.split("\n")[0], EXAMPLE.format(prog=prog))
    add_model(p, None, "model to export")
    p.add_argument("--format", default="hf", choices=["hf"], help="output format")
    data = add_data(p, "validation", "the verification windows (exported model read back by "
                                     "transformers, when torch is installed, against ours)")
    add_calib_samples(data, 2, zero_ok=True)
    add_seqlen(p, 512)
    add_seed(p)
    p.add_argument("--max-shard-mb", type=mib_size, default=2048, help="largest safetensors shard (MiB)")
    add_output_dir(p, "the Hugging Face directory", "keep the shards an interrupted export wrote")
    add_progress(p)
    return p


def parse_args(argv=None, prog: str = "python -m cmoe_jax.export") -> argparse.Namespace:
    return build_parser(prog).parse_args(argv)


def run(args) -> dict:
    check_writable_dir(args.out)
    distributed.require_single_process("python -m cmoe_jax.export")

    settings = ExportSettings(fmt=args.format, calib=args.dataset, calib_split=args.split,
                              data_path=args.data_path, calib_samples=args.calib_samples,
                              seqlen=args.seqlen, seed=args.seed, max_shard_mb=args.max_shard_mb)
    return export(args.model, settings, out=Path(args.out), overwrite=args.overwrite, resume=args.resume,
                  progress=not args.no_progress)


def main(argv=None, prog: str = "python -m cmoe_jax.export") -> int:
    return command_main(parse_args, run, lambda args, result: print(json.dumps(result, indent=1)), argv, prog)


"""`python -m cmoe_jax.export`: write a cmoe_jax model as a Hugging Face directory.

    python -m cmoe_jax.export --model CONVERTED_DIR --format hf --out DIR
        [--calib wikitext2] [--data-path FILE] [--calib-samples 2] [--seqlen 512] [--seed 0]
        [--max-shard-mb 2048] [--overwrite] [--resume]

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

from cmoe_jax.errors import run_job


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cmoe_jax.export", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True,
                   help="converted or fine-tuned cmoe_jax directory (or any model load_model reads)")
    p.add_argument("--format", default="hf", choices=["hf"], help="output format (default hf)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--calib", default="wikitext2", choices=["wikitext2", "c4"],
                   help="text of the verification windows")
    p.add_argument("--calib-split", default="validation")
    p.add_argument("--data-path", help="local text file for the verification windows")
    p.add_argument("--calib-samples", type=int, default=2, help="verification windows (0: no check)")
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-mb", type=float, default=2048, help="largest safetensors shard (MiB)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--resume", action="store_true", help="keep the shards an interrupted export wrote")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def run(args) -> dict:
    from cmoe_jax import distributed

    distributed.require_single_process("python -m cmoe_jax.export")
    from cmoe_jax.export.api import export

    return export(args.model, out=Path(args.out), fmt=args.format, calib=args.calib,
                  calib_split=args.calib_split, data_path=args.data_path,
                  calib_samples=args.calib_samples, seqlen=args.seqlen, seed=args.seed,
                  max_shard_mb=args.max_shard_mb, overwrite=args.overwrite, resume=args.resume,
                  progress=not args.no_progress)


def main(argv=None) -> int:
    args = parse_args(argv)
    result, code = run_job(run, args)
    if code:
        return code
    print(json.dumps(result, indent=1))
    return 0

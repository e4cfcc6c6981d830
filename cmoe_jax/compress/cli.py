"""`python -m cmoe_jax.compress`: ConMoE expert-pool consolidation of an MoE, or a baseline.

Work happens in `<out>.partial/` (each MoE layer's calibration statistics are saved there as
it finishes); the finished model is renamed to `<out>` at the end, so an interrupted run
never leaves a partial checkpoint, and `--resume` continues from the saved layers.
"""
from __future__ import annotations

import argparse
import json

from cmoe_jax.compress.api import METHODS
from cmoe_jax.methods.conmoe import SELECTIONS
from cmoe_jax.errors import run_job


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cmoe_jax.compress", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="MoE checkpoint: converted dir, HF dir or Hub id")
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--ratio", type=float, required=True,
                   help="rho: share of the routed experts removed (0.25, 0.5)")
    p.add_argument("--scope", type=int, default=1,
                   help="conmoe: consecutive MoE layers sharing one prototype pool (1: layer-local)")
    p.add_argument("--selection", default="adaptive", choices=SELECTIONS,
                   help="conmoe prototype rule: adaptive (a*b score over the scope), fixed "
                        "(per-layer budget), usage, reap (a only), distance (b only)")
    p.add_argument("--calib", default="wikitext2", choices=["wikitext2", "c4"], help="calibration dataset")
    p.add_argument("--calib-split", default="validation", help="dataset split for calibration")
    p.add_argument("--data-path", help="local text file for the calibration data")
    p.add_argument("--calib-samples", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory of the compressed model")
    p.add_argument("--resume", action="store_true", help="continue an interrupted compression")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--report", action="store_true", help="write PNG plots and report.json")
    return p.parse_args(argv)


def run(args) -> dict:
    from cmoe_jax import distributed

    distributed.require_single_process("python -m cmoe_jax.compress")
    from cmoe_jax.compress.api import compress

    return compress(args.model, method=args.method, ratio=args.ratio, out=args.out,
                    scope=args.scope, selection=args.selection, calib=args.calib,
                    calib_split=args.calib_split, data_path=args.data_path,
                    calib_samples=args.calib_samples, seqlen=args.seqlen, seed=args.seed,
                    resume=args.resume, overwrite=args.overwrite, report=args.report)


def main(argv=None) -> int:
    args = parse_args(argv)
    result, code = run_job(run, args)
    if code:
        return code
    keys = ("method", "ratio", "scope", "selection", "routed_experts", "prototypes",
            "routed_bytes_before", "routed_bytes_after", "cross_layer_nn_fraction")
    c = result["compression"]
    print(json.dumps({"out": result["out"], **{k: c[k] for k in keys if k in c},
                      "seconds": result["seconds"]}, indent=1))
    return 0

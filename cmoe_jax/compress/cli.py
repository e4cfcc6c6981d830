"""`python -m cmoe_jax.compress`: ConMoE expert-pool consolidation of an MoE, or a baseline.

Work happens in `<out>.partial/` (each MoE layer's calibration statistics are saved there as
it finishes); the finished model is renamed to `<out>` at the end, so an interrupted run
never leaves a partial checkpoint, and `--resume` continues from the saved layers.
"""
from __future__ import annotations

import argparse
import json

from cmoe_jax import distributed
from cmoe_jax.cli_args import (Parser, add_calib_bos, add_calib_samples, add_data, add_model, add_output_dir,
                               add_progress, add_seed, add_seqlen, check_writable_dir, command_main,
                               share)
from cmoe_jax.compress.api import compress
from cmoe_jax.methods import registry
from cmoe_jax.methods.conmoe import DUPLICATE_GATES

EXAMPLE = ("{prog} --model out/s3a3e8 --method conmoe --ratio 0.25 "
           "--data-path wikitext-2/wiki.valid.raw --out out/s3a3e8-conmoe25")


def build_parser(prog: str = "python -m cmoe_jax.compress") -> Parser:
    p = Parser(prog, __doc__.split("\n")[0], EXAMPLE.format(prog=prog))
    add_model(p, None, "MoE checkpoint")
    p.add_argument("--method", required=True, choices=registry.choices("compress"),
                   help=registry.method_help("compress"))
    p.add_argument("--ratio", type=share, required=True,
                   help="rho: share of the routed experts removed (e.g. 0.25, 0.5; 0 keeps the model)")
    registry.add_method_flags(p, "compress")
    p.add_argument("--duplicate-gates", default="sum", choices=DUPLICATE_GATES,
                   help="a token's gates on slots that now share an expert: sum (the paper's), max, "
                        "or renorm (max, rescaled to the token's total gate)")
    data = add_data(p, "validation", "calibration")
    add_calib_samples(data, 8)
    add_calib_bos(data)
    add_seqlen(p, 2048)
    add_seed(p)
    add_output_dir(p, "the compressed model", "continue an interrupted compression", report=True)
    add_progress(p)
    return p


def parse_args(argv=None, prog: str = "python -m cmoe_jax.compress") -> argparse.Namespace:
    return registry.parse_method_args(build_parser(prog), "compress", argv)


def run(args) -> dict:
    check_writable_dir(args.out)
    distributed.require_single_process("python -m cmoe_jax.compress")
    settings = registry.primary("compress", args.method).from_args(args)
    return compress(args.model, settings, out=args.out, resume=args.resume, overwrite=args.overwrite,
                    progress=not args.no_progress)


def report(args, result: dict) -> None:
    keys = ("method", "ratio", "scope", "selection", "distance", "duplicate_gates", "routed_experts", "prototypes",
            "routed_bytes_before", "routed_bytes_after", "cross_layer_nn_fraction")
    c = result["compression"]
    print(json.dumps({"out": result["out"], **{k: c[k] for k in keys if k in c},
                      "seconds": result["seconds"]}, indent=1))


def main(argv=None, prog: str = "python -m cmoe_jax.compress") -> int:
    return command_main(parse_args, run, report, argv, prog)


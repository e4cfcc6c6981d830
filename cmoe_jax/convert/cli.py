"""`python -m cmoe_jax.convert`: CMoE conversion of a dense checkpoint into an S/A/E MoE.

Work happens in `<out>.partial/` (per-layer partitions are saved there as each layer
finishes); the finished model is renamed to `<out>` at the end, so an interrupted run never
leaves a partial checkpoint, and `--resume` continues from the saved layers.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

from cmoe_jax import distributed
from cmoe_jax.cli_args import (Parser, add_calib_bos, add_calib_samples, add_data, add_model, add_output_dir,
                               add_progress, add_seed, add_seqlen, check_writable_dir, command_main,
                               nonneg_int, positive_int)
from cmoe_jax.convert.api import convert
from cmoe_jax.methods import registry
from cmoe_jax.methods.cmoe.report import band_table, layer_table

EXAMPLE = ("{prog} --model smollm2 --config S3A3E8 --shared-by energy "
           "--data-path wikitext-2/wiki.valid.raw --out out/s3a3e8")


class Active(NamedTuple):
    """`--active`, read once: y active routed `experts` of a shape, or a budget `share` F."""
    experts: int | None = None
    share: float | None = None


def active_amount(text: str) -> Active:
    """`--active`: a whole number is y, the active routed experts of a shape (with --shared
    and --experts); a decimal such as 0.25 is a budget, the share of FFN neurons a token runs."""
    if text.strip().isdigit():
        return Active(experts=positive_int(text))
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count of experts (e.g. 3) nor a "
                                         f"share of FFN neurons (e.g. 0.25)")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a budget must be a share in (0, 1], got {text}")
    return Active(share=value)


def build_parser(prog: str = "python -m cmoe_jax.convert") -> Parser:
    p = Parser(prog, __doc__.split("\n")[0], EXAMPLE.format(prog=prog))
    p.add_argument("--method", choices=registry.choices("convert"), default="cmoe",
                   help=registry.method_help("convert"))
    add_model(p, what="dense checkpoint (an MoE is carved hierarchically, --config then being the "
                      "per-expert plan)")
    add_plan(p)
    data = add_data(p, "validation", "calibration")
    add_calib_samples(data, 8)
    add_calib_bos(data)
    add_seqlen(p, None, "calibration window length (default 2048; expertweaver 256)")
    p.add_argument("--stream", action="store_true",
                   help="read, convert and write one decoder layer at a time (peak host memory "
                        "about one layer: models larger than the host's memory); dense sources, "
                        "cmoe and expertweaver")
    registry.add_method_flags(p, "convert")
    add_seed(p)
    add_output_dir(p, "the converted model", "continue an interrupted conversion", report=True)
    add_progress(p)
    return p


def add_plan(p: Parser) -> None:
    plan = p.add_argument_group("plan", "SxAyEz: x shared, y active routed, z total experts "
                                        "(--method expertweaver: only --experts, N_e)")
    plan.add_argument("--config", help="SxAyEz, e.g. S1A1E8")
    plan.add_argument("--shared-by", choices=["rate", "rate-energy", "profile", "energy"], default=None,
                      help="shared-expert neurons: highest activation rate mu (cmoe, its paper's rule), "
                           "highest mu * output energy (cmoe), highest mean gate profile (expertweaver "
                           "default, its paper's rule) or highest output energy "
                           "E[h^2]*||W_down row||^2 (either method)")
    plan.add_argument("--shared", type=nonneg_int, help="x, shared experts (instead of --config)")
    plan.add_argument("--active", type=active_amount,
                      help="y, active routed experts per token (a whole number, with --shared and "
                           "--experts, instead of --config); or a budget F such as 0.25: the mean "
                           "share of FFN neurons a token runs, each layer's shape chosen by its "
                           "measured sensitivity (cmoe; z from --experts, default 8 below F = 0.5 "
                           "and 16 from there; expertweaver: the same as --sparsity 1 - F)")
    plan.add_argument("--experts", type=positive_int, help="z, total experts (instead of --config; "
                                                           "expertweaver: N_e, default 64)")


def parse_args(argv=None, prog: str = "python -m cmoe_jax.convert") -> argparse.Namespace:
    return registry.parse_method_args(build_parser(prog), "convert", argv)


def run(args) -> dict:
    check_writable_dir(args.out)
    distributed.initialize()
    distributed.refuse(**{f"--method {args.method}": registry.primary("convert", args.method).single_process})
    return convert(args.model, settings_from_args(args), out=Path(args.out), resume=args.resume,
                   overwrite=args.overwrite, progress=not args.no_progress)


def settings_from_args(args):
    """The settings the flags describe, read by the chosen method (`--method`)."""
    return registry.primary("convert", args.method).from_args(args)


def report(args, result: dict) -> None:
    """The result as JSON on stdout; each layer's shape and error as a table on stderr (and
    with `--spread auto` each band's held-out loss)."""
    if distributed.is_main():
        print(json.dumps({k: result[k] for k in ("out", "config", "active_share", "seconds")
                          if k in result}, indent=1))
        layers = result.get("layers") or []
        if layers and all("shape" in entry for entry in layers):
            print(layer_table(layers), file=sys.stderr)
        if (result.get("budget") or {}).get("band_trials"):
            print(band_table(result["budget"]), file=sys.stderr)


def main(argv=None, prog: str = "python -m cmoe_jax.convert") -> int:
    return command_main(parse_args, run, report, argv, prog)


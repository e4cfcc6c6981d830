"""`python -m cmoe_jax.convert`: CMoE conversion of a dense checkpoint into an S/A/E MoE.

Work happens in `<out>.partial/` (per-layer partitions are saved there as each layer
finishes); the finished model is renamed to `<out>` at the end, so an interrupted run never
leaves a partial checkpoint, and `--resume` continues from the saved layers.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from cmoe_jax import distributed
from cmoe_jax.cli_args import (Parser, add_calib_samples, add_data, add_model, add_output_dir,
                               add_progress, add_seed, add_seqlen, check_writable_dir, command_main,
                               nonneg_float, nonneg_int, positive_float, positive_int, share)
from cmoe_jax.convert.api import Calibration, ConvertJob, convert
from cmoe_jax.convert.expertweaver_job import DIVERSE_NEEDS_ARC, MIXES, convert_expertweaver
from cmoe_jax.errors import CmoeError
from cmoe_jax.methods.cmoe import ConvertConfig, MoEPlan
from cmoe_jax.methods.expertweaver import WeaveConfig

CMOE_ONLY = ("config", "shared", "active", "dataset", "split", "calib_samples", "k_act", "kmeans_iters",
             "no_normalize", "router_neurons", "no_router_scale", "paper_router", "router_fit_tokens",
             "router_reps", "min_expert_tokens", "expert_parallel", "stream")
EXPERTWEAVER_ONLY = ("sparsity", "alpha_min", "alpha_max", "tau", "assignment", "calib_tasks",
                     "samples_per_task", "arc_path", "calib_mix")
EXAMPLE = ("{prog} --model smollm2 --config S3A3E8 --shared-by energy "
           "--data-path wikitext-2/wiki.valid.raw --out out/s3a3e8")


def build_parser(prog: str = "python -m cmoe_jax.convert") -> Parser:
    p = Parser(prog, __doc__.split("\n")[0], EXAMPLE.format(prog=prog))
    p.add_argument("--method", choices=["cmoe", "expertweaver"], default="cmoe",
                   help="cmoe (CMoE; hierarchical when --model is an MoE) or expertweaver "
                        "(layer-adaptive shared experts, gate-centroid router)")
    add_model(p, what="dense checkpoint (an MoE is carved hierarchically, --config then being the "
                      "per-expert plan)")
    plan = p.add_argument_group("plan", "SxAyEz: x shared, y active routed, z total experts "
                                        "(--method expertweaver: only --experts, N_e)")
    plan.add_argument("--config", help="SxAyEz, e.g. S1A1E8")
    plan.add_argument("--shared-by", choices=["rate", "profile", "energy"], default=None,
                      help="shared-expert neurons: highest activation rate mu (cmoe default, its paper's "
                           "rule), highest mean gate profile (expertweaver default, its paper's rule) or "
                           "highest output energy E[h^2]*||W_down row||^2 (either method)")
    plan.add_argument("--shared", type=nonneg_int, help="x, shared experts (instead of --config)")
    plan.add_argument("--active", type=positive_int, help="y, active routed experts per token (instead of --config)")
    plan.add_argument("--experts", type=positive_int, help="z, total experts (instead of --config; "
                                                           "expertweaver: N_e, default 64)")
    data = add_data(p, "validation", "calibration")
    add_calib_samples(data, 8)
    add_seqlen(p, None, "calibration window length (default 2048; expertweaver 256)")
    cm = p.add_argument_group("cmoe (with --method cmoe)")
    cm.add_argument("--k-act", type=positive_int, default=10, help="K_a: markers per token (ATopK)")
    cm.add_argument("--kmeans-iters", type=positive_int, default=None,
                    help="balanced K-means iterations (default: to convergence; 1 = the authors' code)")
    cm.add_argument("--no-normalize", action="store_true",
                    help="profile unnormalised activations instead of the L2-normalised form")
    cm.add_argument("--router-neurons", type=positive_int, default=None,
                    help=f"representative neurons scoring each routed expert (default "
                         f"{ConvertConfig.router_neurons}; 1 = the paper's router)")
    cm.add_argument("--no-router-scale", action="store_true",
                    help="do not fit per-expert router score scales (the paper's raw |h| scores)")
    cm.add_argument("--paper-router", action="store_true",
                    help="the CMoE paper's router: one representative neuron per expert, closest to "
                         "the centroid, raw |h| scores (= --router-neurons 1 --router-reps centroid "
                         "--no-router-scale)")
    cm.add_argument("--router-fit-tokens", type=positive_int, default=2048,
                    help="calibration tokens used to fit the router score scales")
    cm.add_argument("--router-reps", choices=["centroid", "energy"], default=None,
                    help="router neurons of each expert: the members of highest output energy "
                         "(default) or closest to the cluster centroid (the paper's rule)")
    cm.add_argument("--min-expert-tokens", type=positive_int, default=32,
                    help="MoE source (hierarchical CMoE): an expert reached by fewer calibration "
                         "tokens is profiled on all tokens")
    cm.add_argument("--expert-parallel", type=positive_int, default=1, metavar="N",
                    help="split each converted layer's routed experts over N devices (all-to-all "
                         "token exchange) when it runs forward; the batch uses the rest")
    cm.add_argument("--stream", action="store_true",
                    help="read, convert and write one decoder layer at a time (peak host memory "
                         "about one layer: models larger than the host's memory); dense sources")
    ew = p.add_argument_group("expertweaver (with --method expertweaver)")
    ew.add_argument("--sparsity", type=share, default=0.25, help="share of experts inactive per token")
    ew.add_argument("--alpha-min", type=nonneg_float, default=0.2, help="smallest share of shared neurons per layer")
    ew.add_argument("--alpha-max", type=nonneg_float, default=0.7, help="largest share of shared neurons per layer")
    ew.add_argument("--tau", type=positive_float, default=0.6, help="CV threshold of a specialised neuron")
    ew.add_argument("--assignment", choices=["greedy", "exact"], default="greedy",
                    help="balanced K-means assignment: the paper's greedy one or the exact one")
    ew.add_argument("--calib-mix", choices=MIXES, default="wikitext",
                    help="calibration tasks: WikiText-2 articles (plus ARC as one task), or 'diverse': "
                         "pseudo-tasks of seven formats (prose, ARC questions, question + answer, "
                         "multiple choice, JSON/CSV/tables, Python code, arithmetic; needs --arc-path)")
    ew.add_argument("--calib-tasks", type=positive_int, default=None,
                    help="calibration tasks: WikiText-2 articles (default 32), or with --calib-mix "
                         "diverse pseudo-tasks spread evenly over its formats (default 42)")
    ew.add_argument("--samples-per-task", type=positive_int, default=2, help="windows per calibration task")
    ew.add_argument("--arc-path", help="ARC-Easy JSON lines: its questions form one more task "
                                       "(--calib-mix diverse: four of its formats)")
    add_seed(p)
    add_output_dir(p, "the converted model", "continue an interrupted conversion", report=True)
    add_progress(p)
    return p


def parse_args(argv=None, prog: str = "python -m cmoe_jax.convert") -> argparse.Namespace:
    p = build_parser(prog)
    args = p.parse_args(argv)
    if args.method == "expertweaver":
        p.reject(args, CMOE_ONLY, "to --method expertweaver (it sizes experts by --experts and --sparsity)")
        if args.calib_mix == "diverse" and not args.arc_path:
            p.error(DIVERSE_NEEDS_ARC)
        if args.shared_by == "rate":
            p.error("--shared-by rate is CMoE's rule: --method expertweaver takes profile (its "
                    "paper's rule, the default) or energy")
    else:
        p.reject(args, EXPERTWEAVER_ONLY, "to --method cmoe (ExpertWeaver flags)")
        if args.shared_by == "profile":
            p.error("--shared-by profile is ExpertWeaver's rule: --method cmoe takes rate (its "
                    "paper's rule, the default) or energy")
    return args


def plan_from_args(args):
    if args.config:
        return MoEPlan.parse(args.config, flag="--config")
    if None in (args.shared, args.active, args.experts):
        raise CmoeError("give --config SxAyEz, or all three of --shared, --active, --experts")
    return MoEPlan(args.shared, args.active, args.experts)


def router_options(args) -> dict:
    """Router settings from the flags; `--paper-router` fixes all three and excludes the others."""
    if args.paper_router:
        given = [f for f, v in (("--router-neurons", args.router_neurons), ("--router-reps", args.router_reps),
                                ("--no-router-scale", args.no_router_scale or None)) if v is not None]
        if given:
            raise CmoeError(f"--paper-router sets the router itself: drop {', '.join(given)}")
        return dict(ConvertConfig.PAPER_ROUTER)
    neurons, reps = args.router_neurons, args.router_reps
    return {"router_neurons": ConvertConfig.router_neurons if neurons is None else neurons,
            "router_reps": ConvertConfig.router_reps if reps is None else reps,
            "router_scale": not args.no_router_scale}


def run_expertweaver(args) -> dict:
    cc = WeaveConfig(experts=64 if args.experts is None else args.experts, sparsity=args.sparsity,
                     alpha_min=args.alpha_min, alpha_max=args.alpha_max, tau=args.tau, assignment=args.assignment, seed=args.seed,
                     shared_by=args.shared_by or WeaveConfig.shared_by)
    return convert_expertweaver(args.model, cc, out=Path(args.out), data_path=args.data_path,
                                arc_path=args.arc_path, tasks=args.calib_tasks,
                                samples_per_task=args.samples_per_task, calib_mix=args.calib_mix,
                                seqlen=256 if args.seqlen is None else args.seqlen,
                                resume=args.resume, overwrite=args.overwrite, report=args.report,
                                progress=not args.no_progress)


def run(args) -> dict:
    check_writable_dir(args.out, source=args.model)
    distributed.initialize()
    distributed.refuse(**{"--method expertweaver": args.method == "expertweaver"})
    if args.method == "expertweaver":
        return run_expertweaver(args)
    return convert(args.model, job_from_args(args), out=Path(args.out), resume=args.resume,
                   overwrite=args.overwrite, progress=not args.no_progress)


def job_from_args(args) -> ConvertJob:
    """The CMoE job the flags describe."""
    method = ConvertConfig(plan=plan_from_args(args), k_act=args.k_act, normalize=not args.no_normalize,
                           kmeans_iters=args.kmeans_iters, seed=args.seed,
                           router_fit_tokens=args.router_fit_tokens,
                           shared_by=args.shared_by or ConvertConfig.shared_by,
                           **router_options(args))
    calibration = Calibration(dataset=args.dataset, split=args.split, data_path=args.data_path,
                              samples=args.calib_samples,
                              seqlen=2048 if args.seqlen is None else args.seqlen)
    return ConvertJob(method, calibration, stream=args.stream, expert_parallel=args.expert_parallel,
                      min_expert_tokens=args.min_expert_tokens, report=args.report)


def report(args, result: dict) -> None:
    if distributed.is_main():
        print(json.dumps({k: result[k] for k in ("out", "config", "seconds")}, indent=1))


def main(argv=None, prog: str = "python -m cmoe_jax.convert") -> int:
    return command_main(parse_args, run, report, argv, prog)


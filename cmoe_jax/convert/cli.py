"""`python -m cmoe_jax.convert`: CMoE conversion of a dense checkpoint into an S/A/E MoE.

Work happens in `<out>.partial/` (per-layer partitions are saved there as each layer
finishes); the finished model is renamed to `<out>` at the end, so an interrupted run never
leaves a partial checkpoint, and `--resume` continues from the saved layers.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from cmoe_jax.methods.cmoe import ConvertConfig
from cmoe_jax import distributed
from cmoe_jax.errors import CmoeError, run_job


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cmoe_jax.convert", description=__doc__.split("\n")[0])
    p.add_argument("--method", choices=["cmoe", "expertweaver"], default="cmoe",
                   help="cmoe (default) or expertweaver (paper 002: layer-adaptive shared experts, "
                        "gate-centroid router; see the README's ExpertWeaver section)")
    p.add_argument("--model", default="smollm2", help="dense checkpoint: HF dir, Hub id, .gguf, or "
                   "'smollm2'; an MoE (converted dir, Qwen3-MoE, Mixtral) is carved hierarchically, "
                   "--config then being the per-expert plan")
    p.add_argument("--config", help="SxAyEz, e.g. S1A1E8 (x shared, y active routed, z total experts)")
    p.add_argument("--shared", type=int, help="x (instead of --config)")
    p.add_argument("--active", type=int, help="y (instead of --config)")
    p.add_argument("--experts", type=int, help="z (instead of --config)")
    p.add_argument("--calib", default="wikitext2", choices=["wikitext2", "c4"], help="calibration dataset")
    p.add_argument("--calib-split", default="validation", help="dataset split for calibration")
    p.add_argument("--data-path", help="local text file for the calibration data")
    p.add_argument("--calib-samples", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=None,
                   help="calibration window length (default 2048; expertweaver 256)")
    p.add_argument("--k-act", type=int, default=10, help="K_a: markers per token (ATopK)")
    p.add_argument("--kmeans-iters", type=int, default=None,
                   help="balanced K-means iterations (default: to convergence; 1 = authors' code)")
    p.add_argument("--no-normalize", action="store_true",
                   help="profile unnormalised activations instead of the L2-normalised form")
    p.add_argument("--router-neurons", type=int, default=None,
                   help=f"representative neurons scoring each routed expert (default "
                        f"{ConvertConfig.router_neurons}; 1 = the paper's router)")
    p.add_argument("--no-router-scale", action="store_true",
                   help="do not fit per-expert router score scales (the paper's raw |h| scores)")
    p.add_argument("--paper-router", action="store_true",
                   help="the CMoE paper's router: one representative neuron per expert, closest to "
                        "the centroid, raw |h| scores (= --router-neurons 1 --router-reps centroid "
                        "--no-router-scale)")
    p.add_argument("--router-fit-tokens", type=int, default=2048,
                   help="calibration tokens used to fit the router score scales")
    p.add_argument("--shared-by", choices=["rate", "energy"], default="rate",
                   help="shared-expert neurons: highest activation rate mu (default, the paper's "
                        "rule) or highest output energy E[h^2]*||W_down row||^2")
    p.add_argument("--router-reps", choices=["centroid", "energy"], default=None,
                   help="router neurons of each expert: the members of highest output energy "
                        "(default) or closest to the cluster centroid (the paper's rule)")
    p.add_argument("--min-expert-tokens", type=int, default=32,
                   help="MoE source (hierarchical CMoE): an expert reached by fewer calibration "
                        "tokens is profiled on all tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                   help="split each converted layer's routed experts over N devices (all-to-all "
                        "token exchange) when it runs forward; the batch uses the rest (default 1)")
    p.add_argument("--stream", action="store_true",
                   help="read, convert and write one decoder layer at a time (peak host memory "
                        "about one layer: models larger than the host's memory); dense sources")
    ew = p.add_argument_group("expertweaver (with --method expertweaver; --experts is N_e, default 64)")
    ew.add_argument("--sparsity", type=float, default=0.25, help="share of experts inactive per token")
    ew.add_argument("--alpha-min", type=float, default=0.2)
    ew.add_argument("--alpha-max", type=float, default=0.7)
    ew.add_argument("--tau", type=float, default=0.6, help="CV threshold of a specialised neuron")
    ew.add_argument("--assignment", choices=["greedy", "exact"], default="greedy",
                    help="balanced K-means assignment: the paper's greedy one or the exact one")
    ew.add_argument("--calib-tasks", type=int, default=32, help="WikiText-2 articles used as tasks")
    ew.add_argument("--samples-per-task", type=int, default=2)
    ew.add_argument("--arc-path", help="ARC-Easy JSON lines: its questions form one more task")
    p.add_argument("--out", required=True, help="output directory of the converted model")
    p.add_argument("--resume", action="store_true", help="continue an interrupted conversion")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--report", action="store_true", help="write PNG plots and report.json")
    return p.parse_args(argv)


def plan_from_args(args):
    from cmoe_jax.methods.cmoe import MoEPlan

    if args.config:
        if not re.fullmatch(r"S\d+A\d+E\d+", args.config):
            raise CmoeError(f"--config {args.config!r} is not of the form SxAyEz (e.g. S1A1E8)")
        return MoEPlan.parse(args.config)
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
    return {"router_neurons": args.router_neurons or ConvertConfig.router_neurons,
            "router_reps": args.router_reps or ConvertConfig.router_reps,
            "router_scale": not args.no_router_scale}


def run_expertweaver(args) -> dict:
    from cmoe_jax.methods.expertweaver import WeaveConfig
    from cmoe_jax.convert.expertweaver_job import convert_expertweaver

    if args.config or args.shared is not None or args.active is not None:
        raise CmoeError("--method expertweaver sizes experts itself: give --experts and --sparsity, "
                        "not --config/--shared/--active")
    if args.expert_parallel != 1:
        raise CmoeError("--expert-parallel is not supported with --method expertweaver yet: leave it at 1")
    if args.stream:
        raise CmoeError("--stream is not supported with --method expertweaver yet: drop --stream")
    cc = WeaveConfig(experts=args.experts or 64, sparsity=args.sparsity, alpha_min=args.alpha_min,
                     alpha_max=args.alpha_max, tau=args.tau, assignment=args.assignment, seed=args.seed)
    return convert_expertweaver(args.model, cc, out=Path(args.out), data_path=args.data_path,
                                arc_path=args.arc_path, tasks=args.calib_tasks,
                                samples_per_task=args.samples_per_task, seqlen=args.seqlen or 256,
                                resume=args.resume, overwrite=args.overwrite, report=args.report)


def run(args) -> dict:
    from cmoe_jax.convert.api import convert

    distributed.initialize()
    distributed.refuse(**{"--method expertweaver": args.method == "expertweaver"})
    if args.method == "expertweaver":
        return run_expertweaver(args)
    return convert(args.model, plan_from_args(args), out=Path(args.out), calib=args.calib,
                   calib_split=args.calib_split, data_path=args.data_path,
                   calib_samples=args.calib_samples, seqlen=args.seqlen or 2048, k_act=args.k_act,
                   kmeans_iters=args.kmeans_iters, normalize=not args.no_normalize,
                   seed=args.seed, router_fit_tokens=args.router_fit_tokens,
                   shared_by=args.shared_by, resume=args.resume, **router_options(args),
                   expert_parallel=args.expert_parallel, min_expert_tokens=args.min_expert_tokens,
                   overwrite=args.overwrite, report=args.report, stream=args.stream)


def main(argv=None) -> int:
    args = parse_args(argv)
    result, code = run_job(run, args)
    if code:
        return code
    if distributed.is_main():
        print(json.dumps({k: result[k] for k in ("out", "config", "seconds")}, indent=1))
    return 0

"""ExpertWeaver's command line: its flag group, its checks across flags and its settings."""
from __future__ import annotations

from cmoe_jax.cli_args import nonneg_float, positive_float, positive_int, share
from cmoe_jax.methods.expertweaver.convert import WeaveConfig
from cmoe_jax.methods.expertweaver.job import DIVERSE_NEEDS_ARC, MIXES, TaskCalibration, WeaverSettings

# the convert command's shared flags that ExpertWeaver does not take (it sizes experts itself;
# `--active F`, the budget CMoE allocates per layer, is its `--sparsity 1 - F`)
REFUSES = ("config", "shared", "dataset", "split", "calib_samples", "calib_bos")


def add_flags(g) -> None:
    g.add_argument("--sparsity", type=share, default=0.25, help="share of experts inactive per token")
    g.add_argument("--alpha-min", type=nonneg_float, default=0.2, help="smallest share of shared neurons per layer")
    g.add_argument("--alpha-max", type=nonneg_float, default=0.7, help="largest share of shared neurons per layer")
    g.add_argument("--tau", type=positive_float, default=0.6, help="CV threshold of a specialised neuron")
    g.add_argument("--assignment", choices=["greedy", "exact"], default="greedy",
                   help="balanced K-means assignment: the paper's greedy one or the exact one")
    g.add_argument("--calib-mix", choices=MIXES, default="wikitext",
                   help="calibration tasks: WikiText-2 articles (plus ARC as one task), or 'diverse': "
                        "pseudo-tasks of seven formats (prose, ARC questions, question + answer, "
                        "multiple choice, JSON/CSV/tables, Python code, arithmetic; needs --arc-path)")
    g.add_argument("--calib-tasks", type=positive_int, default=None,
                   help="calibration tasks: WikiText-2 articles (default 32), or with --calib-mix "
                        "diverse pseudo-tasks spread evenly over its formats (default 42)")
    g.add_argument("--samples-per-task", type=positive_int, default=2, help="windows per calibration task")
    g.add_argument("--arc-path", help="ARC-Easy JSON lines: its questions form one more task "
                                      "(--calib-mix diverse: four of its formats)")


def check_args(args, error) -> None:
    if args.active is not None:
        if args.active.share is None or args.active.share >= 1:
            error(f"--active {args.active.experts} with --method expertweaver: give a budget F in (0, 1), the "
                  "share of each token's FFN neurons (--sparsity 1 - F), e.g. --active 0.75")
        if "sparsity" in args.given:
            error("--active F and --sparsity both set the share of experts a token runs: give one")
    if args.calib_mix == "diverse" and not args.arc_path:
        error(DIVERSE_NEEDS_ARC)
    if args.shared_by in ("rate", "rate-energy"):
        error(f"--shared-by {args.shared_by} is CMoE's rule: --method expertweaver takes profile (its "
              "paper's rule, the default) or energy")


def settings_from_args(args) -> WeaverSettings:
    # the budget F as --sparsity 1 - F, rounded so that 0.7 records 0.3
    sparsity = args.sparsity if args.active is None else round(1.0 - args.active.share, 12)
    cc = WeaveConfig(experts=64 if args.experts is None else args.experts, sparsity=sparsity,
                     alpha_min=args.alpha_min, alpha_max=args.alpha_max, tau=args.tau,
                     assignment=args.assignment, seed=args.seed,
                     shared_by=args.shared_by or WeaveConfig.shared_by)
    calibration = TaskCalibration(data_path=args.data_path, arc_path=args.arc_path, tasks=args.calib_tasks,
                                  samples_per_task=args.samples_per_task,
                                  seqlen=256 if args.seqlen is None else args.seqlen, mix=args.calib_mix)
    return WeaverSettings(cc, calibration, report=args.report, stream=args.stream)

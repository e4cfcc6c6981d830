"""CMoE's command line: its flag group, its checks across flags and its settings from them
(the shared plan, data and output flags are the convert command's)."""
from __future__ import annotations

from cmoe_jax.cli_args import nonneg_float, nonneg_int, positive_int
from cmoe_jax.data import Calibration
from cmoe_jax.errors import CmoeError
from cmoe_jax.methods.cmoe.budget import AUTO, DEFAULTS_TEXT, MEASURES, Budget
from cmoe_jax.methods.cmoe.config import ROUTINGS, ConvertConfig
from cmoe_jax.methods.cmoe.settings import ConvertSettings
from cmoe_jax.methods.cmoe.plan import MoEPlan


def add_flags(g) -> None:
    g.add_argument("--k-act", type=positive_int, default=10, help="K_a: markers per token (ATopK)")
    g.add_argument("--kmeans-iters", type=positive_int, default=None,
                   help="balanced K-means iterations (default: to convergence; 1 = the authors' code)")
    g.add_argument("--no-normalize", action="store_true",
                   help="profile unnormalised activations instead of the L2-normalised form")
    g.add_argument("--router-neurons", type=positive_int, default=None,
                   help=f"representative neurons scoring each routed expert (default "
                        f"{ConvertConfig.ROUTER_NEURONS}, or the expert width if narrower; hierarchical "
                        f"carving 8; 1 = the paper's router)")
    g.add_argument("--no-router-scale", action="store_true",
                   help="do not fit per-expert router score scales (the paper's raw |h| scores)")
    g.add_argument("--no-gate-fit", action="store_true",
                   help="leave the gate scales u at 0 (selected experts summed unweighted, the "
                        "paper) instead of fitting them by least squares to the dense FFN's output")
    g.add_argument("--paper-router", action="store_true",
                   help="the CMoE paper's router: one representative neuron per expert, closest to "
                        "the centroid, raw |h| scores, gates 1 (= --router-neurons 1 --router-reps "
                        "centroid --no-router-scale --no-gate-fit)")
    g.add_argument("--router-fit-tokens", type=positive_int, default=2048,
                   help="calibration tokens used to fit the router score scales")
    g.add_argument("--down-fit", type=nonneg_float, default=None, metavar="RIDGE",
                   help="refit each layer's down projections by least squares so that, with the "
                        "tokens routed as the converted layer routes them, its output best matches "
                        "the dense FFN's on the calibration tokens; RIDGE (a share of the mean "
                        "diagonal) pulls towards the dense rows; 0: keep the dense rows (the paper) "
                        f"(default {ConvertConfig.down_fit:g}; an MoE source's sub-experts keep "
                        "their rows)")
    g.add_argument("--down-fit-tokens", type=positive_int, default=ConvertConfig.down_fit_tokens,
                   help="calibration tokens the down projections are refitted on (an even stride "
                        "over the windows; default: all)")
    g.add_argument("--skip-compensation", action="store_true",
                   help="the experts a token skips add a linear prediction of their output from "
                        "their router neurons' activations, fitted with the down projections "
                        "(needs --down-fit above 0; costs E*r*d multiply-adds a token, counted in "
                        "the active share)")
    g.add_argument("--routing", choices=list(ROUTINGS), default=None,
                   help="which routed experts a token runs: its y best-scored (topk, the paper's; "
                        "the default) or those whose score reaches one threshold per layer, fitted "
                        "so the calibration tokens run y on average (threshold: a token the router "
                        "is sure of runs fewer, an unsure one more; the active share holds on the "
                        "calibration tokens, not per token)")
    g.add_argument("--router-reps", choices=["centroid", "energy"], default=None,
                   help="router neurons of each expert: the members of highest output energy "
                        "(default) or closest to the cluster centroid (the paper's rule)")
    g.add_argument("--expert-parallel", type=positive_int, default=1, metavar="N",
                   help="split each converted layer's routed experts over N devices (all-to-all "
                        "token exchange) when it runs forward; the batch uses the rest")
    g.add_argument("--sensitivity", choices=list(MEASURES), default=None,
                   help="with a budget --active F, each layer's damage at a shape: its stream error "
                        "scaled by the loss the model carved to F's uniform shape drops when that "
                        "layer alone is dense again (marginal), the same on the dense model (loss: "
                        "the rise when that layer alone is carved), or the stream error alone "
                        f"(stream); default: {DEFAULTS_TEXT}")
    g.add_argument("--spread", type=spread_arg, default=None, metavar="N",
                   help="with a budget --active F, each layer runs within N experts' worth of "
                        "neurons of F z ('any': no bound; 'auto': the band of z/8 to 3z/8 whose "
                        "conversion has the least loss on calibration text outside the calibration "
                        "windows; default: any with the marginal damage, auto with the others, z/4 "
                        "with --stream)")


def spread_arg(text: str) -> int | str:
    """--spread: a whole number of experts, 0 or more, 'any' or 'auto'."""
    return text if text in ("any", AUTO) else nonneg_int(text)


def check_args(args, error) -> None:
    if args.shared_by == "profile":
        error("--shared-by profile is ExpertWeaver's rule: --method cmoe takes rate (its "
              "paper's rule, the default) or energy")


def budget_share(args) -> float | None:
    """F of `--active F` (a budget), None for a shape."""
    return None if args.active is None else args.active.share


def budget_from_args(args) -> Budget | None:
    """The budget of `--active F` (a decimal share), None for a shape."""
    share = budget_share(args)
    if share is None:
        for flag, value in (("--sensitivity", args.sensitivity), ("--spread", args.spread)):
            if value is not None:
                raise CmoeError(f"{flag} shapes layers for a budget: give --active F (e.g. 0.25)")
        return None
    if args.spread == AUTO and args.stream:
        raise CmoeError("--spread auto converts the model once per band, which a streamed job "
                        "(--stream) cannot hold: give --spread N")
    if args.config or args.shared is not None:
        given = "--config" if args.config else "--shared"
        raise CmoeError(f"--active {share:g} is a budget (each layer's shape chosen for it) and "
                        f"{given} a shape: give one of them")
    return Budget(share, args.experts,
                  measure_by=args.sensitivity,
                  spread={None: "default", "any": None}.get(args.spread, args.spread))


def plan_from_args(args) -> MoEPlan | None:
    """The uniform shape (None with a budget, `budget_from_args`)."""
    if budget_share(args) is not None:
        return None
    if args.config:
        return MoEPlan.parse(args.config, flag="--config")
    active = None if args.active is None else args.active.experts
    if None in (args.shared, active, args.experts):
        raise CmoeError("give --config SxAyEz, or all three of --shared, --active, --experts, or a "
                        "budget --active F (e.g. 0.25)")
    return MoEPlan(args.shared, active, args.experts)


def router_options(args) -> dict:
    """Router and fit settings from the flags; `--paper-router` fixes all five and excludes
    the others."""
    if args.paper_router:
        given = [f for f, v in (("--router-neurons", args.router_neurons), ("--router-reps", args.router_reps),
                                ("--no-router-scale", args.no_router_scale or None),
                                ("--no-gate-fit", args.no_gate_fit or None),
                                ("--down-fit", args.down_fit),
                                ("--skip-compensation", args.skip_compensation or None),
                                ("--routing", args.routing)) if v is not None]
        if given:
            raise CmoeError(f"--paper-router sets the router itself: drop {', '.join(given)}")
        return dict(ConvertConfig.PAPER_ROUTER)
    neurons, reps = args.router_neurons, args.router_reps
    return {"router_neurons": neurons,
            "router_reps": ConvertConfig.router_reps if reps is None else reps,
            "router_scale": not args.no_router_scale, "gate_fit": not args.no_gate_fit,
            "down_fit": ConvertConfig.down_fit if args.down_fit is None else args.down_fit,
            "routing": ConvertConfig.routing if args.routing is None else args.routing}


def settings_from_args(args) -> ConvertSettings:
    """The CMoE conversion the flags describe (hierarchical when the source is an MoE)."""
    method = ConvertConfig(plan=plan_from_args(args), k_act=args.k_act, normalize=not args.no_normalize,
                           kmeans_iters=args.kmeans_iters, seed=args.seed,
                           router_fit_tokens=args.router_fit_tokens, down_fit_tokens=args.down_fit_tokens,
                           shared_by=args.shared_by or ConvertConfig.shared_by,
                           skip_compensation=args.skip_compensation, **router_options(args))
    calibration = Calibration(dataset=args.dataset, split=args.split, data_path=args.data_path,
                              samples=args.calib_samples, bos=args.calib_bos,
                              seqlen=2048 if args.seqlen is None else args.seqlen)
    return ConvertSettings(method, calibration, stream=args.stream, expert_parallel=args.expert_parallel,
                           min_expert_tokens=args.min_expert_tokens, report=args.report,
                           budget=budget_from_args(args))

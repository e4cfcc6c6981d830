"""What a CMoE conversion is asked for: the shape (one for every layer, or one per layer),
the profiling, carving and router options (the CLI flags, minus I/O)."""
from __future__ import annotations

import dataclasses

from cmoe_jax.errors import CmoeError
from cmoe_jax.methods.cmoe.plan import MoEPlan


class ConversionError(CmoeError):
    """Bad conversion input (plan, calibration data, activations)."""


SHARED_BY = ("energy", "rate", "rate-energy")
ROUTER_REPS = ("centroid", "energy")
ROUTINGS = ("topk", "threshold")

@dataclasses.dataclass(frozen=True)
class ConvertConfig:
    """What to convert to and how (the CLI flags, minus I/O)."""

    plan: MoEPlan | None  # every layer's shape; None when `layer_plans` gives each its own
    k_act: int = 10
    normalize: bool = True
    kmeans_iters: int | None = None  # None: iterate to convergence; 1: the authors' code
    seed: int = 0
    # Router: r representative neurons per expert (1: the paper's; None: `ROUTER_NEURONS`, or
    # the expert width where that is narrower), and per-expert score scales fitted on
    # `router_fit_tokens` calibration tokens (False: the paper's raw |h|).
    router_neurons: int | None = None
    router_scale: bool = True
    router_fit_tokens: int = 2048
    # Shared experts: neurons of highest activation rate mu times output energy E[h^2] ||W_down
    # row||^2 ("rate-energy", the default: best of the three on SmolLM2 and Gemma 3 at 25% and
    # 75% active), of highest mu ("rate", the paper's rule) or of highest energy ("energy").
    shared_by: str = "rate-energy"
    # Router neurons of each expert: its members closest to the cluster centroid ("centroid",
    # the paper's rule) or of highest output energy ("energy", the default: the neurons whose
    # output matters most; best measured on every plan of the README's table).
    router_reps: str = "energy"
    # Gate scales u of the gates 1 + s'u: fitted by least squares to make up for the
    # unselected experts on the calibration tokens, or 0 (False: the paper's unweighted sum).
    gate_fit: bool = True
    # Down projections refitted by least squares so the layer's output, with the tokens'
    # experts as routed, best matches the dense FFN's on `down_fit_tokens` calibration tokens
    # (None: all): the ridge (a share of the mean diagonal, pulling towards the dense rows);
    # 0: the dense FFN's rows as carved (the paper). 0.1: best of 0.01-1 on SmolLM2 S3A3E8
    # (docs/results/cmoe.md, ablation).
    down_fit: float = 0.1
    down_fit_tokens: int | None = None
    # The experts a token skips add a linear prediction of their output from their router
    # neurons' activations (`cmoe_jax.moe.skip_term`), fitted with the down projections
    # (needs down_fit > 0). Off by default: it helps SmolLM2, not Gemma 3 (docs/methods/cmoe.md).
    skip_compensation: bool = False
    # Which routed experts a token runs: its y best-scored ("topk", the paper's), or every
    # expert whose score reaches one threshold per layer, fitted so the calibration tokens
    # run y on average ("threshold": a token the router is sure of runs fewer, an unsure one
    # more; `cmoe_jax.moe.routers.cmoe`).
    routing: str = "topk"
    # One shape per layer (a budget's allocation, `cmoe_jax.methods.cmoe.budget`); None in
    # it keeps that layer's dense FFN. None: every layer gets `plan`.
    layer_plans: tuple[MoEPlan | None, ...] | None = None

    # The CMoE paper's analytical router: one representative neuron per expert, the member
    # closest to the centroid, raw |h| scores, gates 1, the experts' dense down rows
    # (`--paper-router`).
    PAPER_ROUTER = {"router_neurons": 1, "router_reps": "centroid", "router_scale": False,
                    "gate_fit": False, "down_fit": 0.0, "routing": "topk"}

    # 16 router neurons: better than 8 on SmolLM2 and Gemma 3 at 25% and 75% active and about
    # as good as 32 at half the router's cost (docs/results/cmoe.md, ablation)
    ROUTER_NEURONS = 16

    def neurons_for(self, expert_width: int) -> int:
        """r for experts of `expert_width` neurons: as given, or by default `ROUTER_NEURONS`
        capped at the width."""
        if self.router_neurons is not None:
            return self.router_neurons
        return min(self.ROUTER_NEURONS, expert_width)

    def plan_at(self, layer: int) -> MoEPlan | None:
        """Layer `layer`'s shape (None: its dense FFN is kept)."""
        return self.plan if self.layer_plans is None else self.layer_plans[layer]

    def layer_shapes(self, num_layers: int) -> list[MoEPlan | None]:
        if self.layer_plans is not None and len(self.layer_plans) != num_layers:
            raise ConversionError(f"{len(self.layer_plans)} layer shapes for a model of {num_layers} layers")
        return [self.plan_at(i) for i in range(num_layers)]

    @property
    def label(self) -> str:
        """The uniform shape's name, or "per-layer" (progress bars, reports)."""
        return "per-layer" if self.plan is None else self.plan.name

    def to_dict(self) -> dict:
        shapes = None if self.layer_plans is None else [
            "dense" if p is None else p.name for p in self.layer_plans]
        return {"config": self.label, "layer_plans": shapes, "k_act": self.k_act, "normalize": self.normalize,
                "kmeans_iters": self.kmeans_iters, "seed": self.seed,
                "router_neurons": self.router_neurons, "router_scale": self.router_scale,
                "router_fit_tokens": self.router_fit_tokens, "shared_by": self.shared_by,
                "router_reps": self.router_reps, "gate_fit": self.gate_fit,
                "down_fit": self.down_fit, "down_fit_tokens": self.down_fit_tokens,
                "skip_compensation": self.skip_compensation, "routing": self.routing}

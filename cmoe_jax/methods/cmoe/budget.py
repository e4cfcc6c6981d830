"""Layer-adaptive CMoE: a budget (the mean share F of FFN neurons a token runs) instead of
one shape for every layer.

Layers are not equally hurt by carving. Each layer's damage at every candidate shape is
measured where the model will run, on the model carved to the budget's uniform shape
(`cmoe_jax.methods.cmoe.sensitivity`: the stream error of each candidate, scaled per layer
by the loss the carved model drops when that layer alone is dense again). An exact
knapsack (`cmoe_jax.carving.allocation`) then picks one shape per layer, each within
`spread` experts of the uniform one, so the mean active share is F and the summed damage
least; the conversion carves each layer to its shape on the converted stream, as a uniform
one does. With the dense-stream damages the band is chosen per model on held-out text
(`cmoe_jax.methods.cmoe.spread_choice`).

Candidates with z experts: k = 1 .. z-1 experts' worth of neurons active, split
S(k//2)A(k - k//2)Ez (S0A1E8, S1A1E8, S1A2E8, ..., S3A4E8), and k = z, the dense FFN kept.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from cmoe_jax.carving.allocation import BudgetError, allocate
from cmoe_jax.methods.cmoe.config import ConversionError, ConvertConfig
from cmoe_jax.methods.cmoe.plan import MoEPlan

MEASURES = ("marginal", "loss", "stream")  # the damages a budget's allocation can minimise
TOLERANCE = 0.01  # the mean active share met to within 1% of the budget
MARGINAL_BELOW = 0.5  # budgets below it take the marginal damage, the others the dense-stream one


def default_measure(active: float) -> str:
    """The damage measure of the defaults at budget F, each the best measured at its end
    (docs/methods/cmoe.md). Far from dense, a layer's damage is what it costs inside the
    carved model ("marginal"); near dense, the carved model's drops stop adding up (on
    SmolLM2 at 75% they sum to 1.5x its gap to dense) and the dense stream's loss rises
    ("loss") are the better guide."""
    return "marginal" if active < MARGINAL_BELOW else "loss"


def default_experts(active: float) -> int:
    """The expert count z of the candidate shapes at budget F. Near dense, finer candidates
    (z = 16: steps of 1/16 of the FFN) let the allocation follow the measured damage more
    closely: on SmolLM2 at 75% the loss damage's excess perplexity fell from 0.86 to 0.74 of
    the uniform S3A3E8's (docs/methods/cmoe.md)."""
    return 8 if active < MARGINAL_BELOW else 16


def default_spread(measure_by: str) -> int | str | None:
    """The marginal damage holds far from the uniform shape (any spread); the dense-stream
    ones only near it, and how near differs between models (at 75% the best band screened on
    test windows was 5 of 16 experts on SmolLM2, 6 on Gemma 3 270M): "auto" chooses it on
    held-out text (`cmoe_jax.methods.cmoe.spread_choice`)."""
    return None if measure_by == "marginal" else AUTO


def auto_spreads(experts: int) -> list[int]:
    """The bands `--spread auto` tries: z/8 to 3z/8 experts (2 to 6 of 16, 1 to 3 of 8)."""
    return list(range(max(1, experts // 8), max(1, 3 * experts // 8) + 1))


AUTO = "auto"
DEFAULTS_TEXT = (f"marginal below F = {MARGINAL_BELOW:g} with 8 experts and any spread, loss from there "
                 "with 16 experts, each layer within 2 to 6 of F z, the band of least held-out loss "
                 "(auto; a streamed job: within z/4)")


@dataclasses.dataclass(frozen=True)
class Budget:
    """F = `active`, the mean share of FFN neurons a token runs (shared plus routed, averaged
    over the layers), met with shapes of `experts` equal-width experts."""

    active: float
    experts: int | None = None  # z of every candidate shape (None: `default_experts`)
    measure_by: str | None = None  # the damage: "marginal", "loss" or "stream" (None: `default_measure`)
    spread: int | None | str = "default"  # a layer runs within this many experts of F z (None: any
    #              shape; "auto": the band of least held-out loss; "default": `default_spread`)

    def __post_init__(self):
        if self.experts is None:
            object.__setattr__(self, "experts", default_experts(self.active))
        if self.measure_by is None:
            object.__setattr__(self, "measure_by", default_measure(self.active))
        if self.spread == "default":
            object.__setattr__(self, "spread", default_spread(self.measure_by))

    def to_json(self) -> dict:
        return {"active": self.active, "experts": self.experts, "sensitivity": self.measure_by,
                "spread": self.spread}

    def spreads(self) -> list[int | None]:
        """The bands this budget tries: `auto_spreads` for "auto", else its own."""
        return auto_spreads(self.experts) if self.spread == AUTO else [self.spread]

    def with_spread(self, spread: int | None) -> "Budget":
        return dataclasses.replace(self, spread=spread)

    def streamed(self) -> "Budget":
        """This budget for a job that streams its layers: "auto" becomes a quarter of the FFN."""
        return self.with_spread(self.experts // 4) if self.spread == AUTO else self

    def candidates(self) -> list[MoEPlan | None]:
        """The shapes a layer may get, the one of index k-1 running k experts' worth of
        neurons (None: the dense FFN kept)."""
        z = self.experts
        return [MoEPlan(k // 2, k - k // 2, z) for k in range(1, z)] + [None]

    def units(self) -> np.ndarray:
        return np.arange(1, self.experts + 1)

    def target_units(self, num_layers: int) -> int:
        """Experts' worth of active neurons summed over the layers; BudgetError if no whole
        number of them meets F within `TOLERANCE`."""
        z = self.experts
        if not 0 < self.active <= 1:
            raise BudgetError(f"--active {self.active:g} must be a share in (0, 1]")
        target = max(num_layers, round(self.active * z * num_layers))
        met = target / (z * num_layers)
        if abs(met - self.active) > TOLERANCE * self.active:
            raise BudgetError(f"--active {self.active:g} cannot be met within 1% by {num_layers} layers "
                              f"of {z} experts (shares in steps of 1/{z * num_layers}; the nearest "
                              f"reachable is {met:.4g}): choose another budget or more --experts")
        return target

    def uniform_index(self) -> int | None:
        """The candidate every layer would get were all equally sensitive (None: F is not a
        whole number of experts per layer)."""
        k = self.active * self.experts
        return int(round(k)) - 1 if abs(k - round(k)) < 1e-9 else None

    def nearest_uniform(self) -> int:
        """The candidate nearest to F z experts' worth: the operating point the "marginal"
        damage is measured at (the uniform shape where F z is whole)."""
        return int(np.clip(round(self.active * self.experts), 1, self.experts)) - 1

    def allowed(self) -> np.ndarray:
        """[K] which candidates a layer may get: those within `spread` experts of F z.

        The measured damages are each layer's alone, on the dense model's stream; carved
        together, far-from-uniform layers compound (a layer carved to one expert feeds every
        later one), so a bounded spread keeps the allocation where the measure holds."""
        units = self.units()
        if self.spread == AUTO:
            raise ValueError("--spread auto allocates once per band: use with_spread(band)")
        if self.spread is None:
            return np.ones(units.shape, bool)
        return np.abs(units - self.active * self.experts) <= self.spread + 1e-9

    def allocate(self, damage: np.ndarray) -> list[MoEPlan | None]:
        """Each layer's shape: least summed `damage` [L, K] at mean active share F, among the
        `allowed` shapes."""
        damage = np.where(self.allowed()[None, :], np.asarray(damage, np.float64), np.inf)
        picked = allocate(damage, self.units(), self.target_units(damage.shape[0]), self.uniform_index())
        candidates = self.candidates()
        return [candidates[k] for k in picked]


def check_budget(budget: Budget, cfg, cc: ConvertConfig) -> None:
    """Refuse, before any work, a budget no allocation can meet or shapes that cannot carve."""
    if budget.measure_by not in MEASURES:
        raise ConversionError(f"--sensitivity {budget.measure_by!r} must be one of {', '.join(MEASURES)}")
    if budget.spread not in (None, AUTO) and budget.spread < 0:
        raise ConversionError(f"--spread {budget.spread} must be 0 or more experts (or 'any', 'auto')")
    try:
        target = budget.target_units(cfg.num_layers)
        if not any(reaches(budget.with_spread(s), cfg.num_layers, target) for s in budget.spreads()):
            raise BudgetError(f"--active {budget.active:g} with --spread {budget.spread} leaves no "
                              f"shape within {max(budget.spreads())} experts of "
                              f"{budget.active * budget.experts:g}: widen --spread")
        for plan in budget.candidates()[:-1]:
            plan.validate(cfg.intermediate_size, cc.k_act)
    except ValueError as e:
        raise ConversionError(str(e)) from e
    m = cfg.intermediate_size // budget.experts
    if cc.router_neurons is not None and not 1 <= cc.router_neurons <= m:
        raise ConversionError(f"--router-neurons {cc.router_neurons} must be between 1 and the "
                              f"expert width {m}")


def reaches(budget: Budget, num_layers: int, target: int) -> bool:
    """Whether `num_layers` layers of `budget`'s allowed shapes can sum to `target` units."""
    reach = budget.units()[budget.allowed()]
    return bool(reach.size and reach.min() * num_layers <= target <= reach.max() * num_layers)


def adaptive_config(cc: ConvertConfig, budget: Budget, damage: np.ndarray) -> ConvertConfig:
    """`cc` with the per-layer shapes `budget` allocates on the measured `damage`."""
    return dataclasses.replace(cc, plan=None, layer_plans=tuple(budget.allocate(damage)))


__all__ = ["AUTO", "DEFAULTS_TEXT", "MEASURES", "Budget", "BudgetError", "adaptive_config", "check_budget"]

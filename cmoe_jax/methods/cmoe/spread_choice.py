"""`--spread auto`: the band of shapes around the uniform one, chosen per model on held-out text.

The dense-stream damages ("loss", "stream") are each layer's alone, and hold only near the
budget's uniform shape; how far from it they still rank the allocations right differs between
models (at 75% on 40 test windows: a band of 5 of 16 experts did best on SmolLM2, 6 on
Gemma 3 270M). So the allocation is made at each band of `budget.auto_spreads`, each distinct
one converted as the job will convert it, and the one of least next-token loss on windows of
the calibration text that no calibration window touches is kept (ties: the narrower band).
Each band's loss is saved as it comes, so a resumed job converts only the bands not yet tried.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from cmoe_jax.carving.allocation import BudgetError
from cmoe_jax.methods.cmoe.budget import Budget
from cmoe_jax.methods.cmoe.config import ConvertConfig
from cmoe_jax.methods.cmoe.convert import conversion_mesh, convert_model
from cmoe_jax.methods.cmoe.sensitivity import pass_nll

HELD_OUT_WINDOWS = 8  # windows of the calibration length the bands are compared on


@dataclasses.dataclass(frozen=True)
class BandTrial:
    """One band's allocation and its held-out loss (None: no allocation within it meets F)."""

    spread: int
    shapes: list[str] | None
    held_out_nll: float | None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class BandChoice:
    plans: list  # the chosen band's per-layer shapes
    spread: int  # that band
    trials: list[BandTrial]  # every band tried, in order

    def to_json(self) -> dict:
        return {"spread_chosen": self.spread, "band_trials": [t.to_json() for t in self.trials]}


def shape_names(plans) -> list[str]:
    return ["dense" if p is None else p.name for p in plans]


def band_plans(budget: Budget, spread: int, damage: np.ndarray):
    """The allocation within `spread` experts of F z, or None when none meets the budget."""
    try:
        return budget.with_spread(spread).allocate(damage)
    except BudgetError:
        return None


@dataclasses.dataclass
class BandRun:
    """What the bands are scored on and how: this process's calibration and held-out windows,
    the trial rows of a resumed job (in band order) and the callback saving each new one."""

    calib: np.ndarray
    held_out: np.ndarray
    saved: list = dataclasses.field(default_factory=list)
    on_trial: Callable[[int, dict], None] | None = None
    progress: bool = True
    expert_parallel: int = 1


def held_out_nll(model, cc: ConvertConfig, plans, run: BandRun) -> float:
    """Mean next-token NLL on the held-out windows (the mean over all processes') of the
    model converted on the calibration windows with per-layer `plans`."""
    method = dataclasses.replace(cc, plan=None, layer_plans=tuple(plans))
    converted, _ = convert_model(model, run.calib, method, progress=run.progress,
                                 expert_parallel=run.expert_parallel)
    mesh = conversion_mesh(method, run.held_out.shape[0], expert_parallel=run.expert_parallel,
                           plans=[p for p in plans if p is not None])
    return pass_nll(converted, converted.layers, run.held_out, mesh, lambda inputs: inputs.layer.mlp)


def choose_band(model, cc: ConvertConfig, budget: Budget, damage: np.ndarray, run: BandRun) -> BandChoice:
    """The band whose allocation on `damage` has the least held-out loss."""
    trials: list[BandTrial] = []
    by_shapes: dict[tuple, float] = {}
    plans_of: dict[int, list] = {}
    for i, spread in enumerate(budget.spreads()):
        plans = plans_of[spread] = band_plans(budget, spread, damage)
        names = None if plans is None else shape_names(plans)
        if i < len(run.saved):
            nll = run.saved[i]["held_out_nll"]
        elif plans is None:
            nll = None
        elif tuple(names) in by_shapes:  # a wider band that allocates the same shapes
            nll = by_shapes[tuple(names)]
        else:
            nll = held_out_nll(model, cc, plans, run)
        if names is not None:
            by_shapes[tuple(names)] = nll
        trials.append(BandTrial(spread, names, nll))
        if run.on_trial is not None and i >= len(run.saved):
            run.on_trial(i, trials[-1].to_json())
    best = min((t for t in trials if t.held_out_nll is not None), key=lambda t: (t.held_out_nll, t.spread))
    return BandChoice(plans_of[best.spread], best.spread, trials)

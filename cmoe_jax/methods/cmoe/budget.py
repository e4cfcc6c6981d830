"""Layer-adaptive CMoE: a budget (the mean share F of FFN neurons a token runs) instead of
one shape for every layer.

Layers are not equally hurt by carving. One pass over the calibration windows through the
dense model carves every layer at every candidate shape on its own FFN input and measures
the damage: the squared change of the residual stream after the layer, relative to that
stream's energy (what the next layer reads; a norm after the FFN, as in Gemma, included).
An exact knapsack (`cmoe_jax.carving.allocation`) then picks one shape per layer so the mean
active share is F and the summed damage least; the conversion carves each layer to its shape
on the converted stream, as a uniform one does.

Candidates with z experts: k = 1 .. z-1 experts' worth of neurons active, split
S(k//2)A(k - k//2)Ez (S0A1E8, S1A1E8, S1A2E8, ..., S3A4E8), and k = z, the dense FFN kept.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
from flax import nnx

from cmoe_jax.carving.allocation import BudgetError, allocate
from cmoe_jax.methods.cmoe.convert import (ConversionError, ConvertConfig, carve_on_main,
                                           conversion_mesh, layer_profile, moe_spec, slices_for,
                                           stream_error)
from cmoe_jax.methods.cmoe.plan import MoEPlan
from cmoe_jax.methods.cmoe.router_fit import fit_router
from cmoe_jax.models.ffn import filled_ffn
from cmoe_jax.profiling.layer_pass import LayerInput, layer_pass, start_pass

TOLERANCE = 0.01  # the mean active share met to within 1% of the budget


@dataclasses.dataclass(frozen=True)
class Budget:
    """F = `active`, the mean share of FFN neurons a token runs (shared plus routed, averaged
    over the layers), met with shapes of `experts` equal-width experts."""

    active: float
    experts: int = 8

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

    def allocate(self, damage: np.ndarray) -> list[MoEPlan | None]:
        """Each layer's shape: least summed `damage` [L, K] at mean active share F."""
        picked = allocate(damage, self.units(), self.target_units(damage.shape[0]), self.uniform_index())
        candidates = self.candidates()
        return [candidates[k] for k in picked]

    def met(self, plans) -> float:
        """The mean active share of per-layer `plans`."""
        return float(np.mean([1.0 if p is None else (p.shared + p.active) / p.total for p in plans]))


def check_budget(budget: Budget, cfg, cc: ConvertConfig) -> None:
    """Refuse, before any work, a budget no allocation can meet or shapes that cannot carve."""
    try:
        budget.target_units(cfg.num_layers)
        for plan in budget.candidates()[:-1]:
            plan.validate(cfg.intermediate_size, cc.k_act)
    except ValueError as e:
        raise ConversionError(str(e)) from e
    m = cfg.intermediate_size // budget.experts
    if cc.router_neurons is not None and not 1 <= cc.router_neurons <= m:
        raise ConversionError(f"--router-neurons {cc.router_neurons} must be between 1 and the "
                              f"expert width {m}")


class DamageStep:
    """The layer pass's step of the damage measurement: carve layer i at every candidate
    shape on its dense FFN input, measure each shape's damage, hand the dense FFN back (the
    stream stays the dense model's). `rows[i]` [K]: layer i's damage per candidate."""

    def __init__(self, cfg, cc: ConvertConfig, budget: Budget, mesh, done=(),
                 on_row: Callable[[int, list], None] | None = None):
        self.cfg, self.cc, self.budget, self.mesh = cfg, cc, budget, mesh
        self.rows, self.on_row = [list(r) for r in done], on_row

    def __call__(self, inputs: LayerInput) -> nnx.Module:
        layer, x = inputs.layer, inputs.ffn_input
        if inputs.index < len(self.rows):
            return layer.mlp
        dense = inputs.stream_after(layer.mlp, self.mesh)
        markers, mu, out_energy = layer_profile(layer, x, self.cc)
        row = []
        for plan in self.budget.candidates()[:-1]:
            carving = carve_on_main(markers, mu, out_energy, self.cc, plan)
            ffn = filled_ffn(self.cfg, moe_spec(self.cfg, self.cc, plan), slices_for(layer, carving),
                             layer.mlp.gate[...].dtype)
            fit_router(ffn, x, self.cc, self.mesh)
            row.append(stream_error(inputs, ffn, dense, self.mesh))
        row.append(0.0)  # the dense FFN kept
        self.rows.append(row)
        if self.on_row is not None:
            self.on_row(inputs.index, row)
        return layer.mlp


def measure_damage(model, calib: np.ndarray, cc: ConvertConfig, budget: Budget, *, devices=None,
                   progress: bool = True, done=(),
                   on_row: Callable[[int, list], None] | None = None) -> np.ndarray:
    """[L, K] damage of carving each layer of the dense `model` to each of `budget`'s
    candidate shapes, on the calibration windows `calib` [N, T] (`measure_streamed`: one
    layer read at a time). `done`, `on_row`: rows measured before (resume) and a callback
    saving each new row."""
    calib = np.asarray(calib, np.int32)
    mesh = conversion_mesh(cc, calib.shape[0], devices)
    h, rope = start_pass(model, calib, mesh)
    step = DamageStep(model.config, cc, budget, mesh, done, on_row)
    layer_pass(model.layers, h, rope, mesh, step,
               desc="measuring each layer's damage", progress=progress)
    return np.asarray(step.rows, np.float64)


def adaptive_config(cc: ConvertConfig, budget: Budget, damage: np.ndarray) -> ConvertConfig:
    """`cc` with the per-layer shapes `budget` allocates on the measured `damage`."""
    return dataclasses.replace(cc, plan=None, layer_plans=tuple(budget.allocate(damage)))


__all__ = ["Budget", "BudgetError", "DamageStep", "adaptive_config", "check_budget", "measure_damage"]

"""How much carving each layer to each candidate shape costs the model (`--active F`).

Three measures; "marginal" (the default below half active, `budget.default_measure`) is
taken at the budget's operating point:

- **marginal**: one pass of the calibration windows through the model carved
  to the budget's uniform shape (each layer carved on the stream of the carved layers
  before it, as a uniform conversion does). At each layer every candidate is carved on
  that stream and its *stream error* e[l, k] taken (below); then, one pass per layer, the
  drop of the carved model's next-token loss when layer l alone gets its dense FFN back,
  per unit of e[l, uniform]: g[l]; and, one more pass per layer, the *rise* r[l] of that
  loss when layer l alone is carved one candidate below the uniform shape. Measured where
  the model will run, the drops add up (on SmolLM2 at 25% active the 30 drops sum to 3.03
  nats against the uniform model's 2.99 above dense); measured one layer at a time on the
  dense model they do not (layer 1 costs 0.045 nats carved alone, 0.18 inside the carved
  model). The rise is measured rather than read off g[l]: on Gemma 3 270M two layers drop
  nothing when restored, yet carving either one step further costs 0.05-0.06 nats. The
  carved layers (both carvings) are held in memory between the passes (about 2F of the FFN
  weights, also in a streamed job).
- **loss**: the same on the dense model's own stream: e[l, k] of layer l carved on its
  dense input, g[l] the loss rise when layer l alone is carved to the reference candidate.
- **stream**: e[l, k] alone.

The stream error is ||h_moe - h_dense||^2 / ||h_dense||^2 of the residual stream after the
layer, over all calibration tokens. The damage is g[l] * e[l, k] ("marginal", "loss") or
e[l, k] ("stream"); below the marginal measure's operating point u it is the drop plus
r[l], scaled by (e[l, k] - e[l, u]) / (e[l, u-1] - e[l, u]) for shapes further down.
docs/methods/cmoe.md has the screen that chose the default.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from cmoe_jax.methods.cmoe.config import ConvertConfig
from cmoe_jax.methods.cmoe.convert import (carve_on_main, conversion_mesh, layer_profile, moe_spec,
                                           slices_for, stream_error)
from cmoe_jax.methods.cmoe.layer_fit import fit_layer
from cmoe_jax.models.ffn import filled_ffn
from cmoe_jax.calibration_pass.layer_pass import LayerInput, layer_pass, start_pass, stream_nll

REFERENCE = 1  # the candidate whose loss rise calibrates a layer's errors: S1A1E8 with 8 experts
LOSS_WINDOWS = 2  # calibration windows the loss is measured on
FLOOR = 1e-9  # least loss rise counted: no layer is free to carve


@dataclasses.dataclass
class Measured:
    """How a measurement runs: what was measured before (a resume: stream-error rows,
    gains and rises of the first layers), the callbacks that save each new one, the devices
    and whether to show progress."""

    errors: list = dataclasses.field(default_factory=list)
    gains: list = dataclasses.field(default_factory=list)
    on_error: Callable[[int, list], None] | None = None
    on_gain: Callable[[int, float], None] | None = None
    rises: list = dataclasses.field(default_factory=list)
    on_rise: Callable[[int, float], None] | None = None
    devices: list | None = None
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class Sensitivity:
    errors: np.ndarray  # [L, K] stream error of each layer at each candidate (dense: 0)
    gains: np.ndarray | None  # [L] loss rise per unit stream error (None: not measured)
    rises: np.ndarray | None = None  # [L] marginal: loss rise one candidate below `operating`
    operating: int | None = None  # marginal: the candidate the model was carved to

    def damage(self, measure_by: str | None = None) -> np.ndarray:
        """The damage table of `measure_by` ("stream", "loss"; None: the one measured)."""
        if measure_by == "stream" or self.gains is None:
            return self.errors
        damage = self.gains[:, None] * self.errors
        if self.rises is not None and measure_by in (None, "marginal"):
            u = self.operating  # below it: the measured drop, plus the rise per unit of error past u
            per_error = np.maximum(self.rises, FLOOR) / np.maximum(self.errors[:, u - 1] - self.errors[:, u], 1e-30)
            damage[:, :u] = damage[:, u:u + 1] + per_error[:, None] * (self.errors[:, :u] - self.errors[:, u:u + 1])
        return damage


def carved_candidate(cfg, layer, x, cc: ConvertConfig, plan, mesh, profile=None) -> nnx.Module:
    """Layer's FFN carved to `plan` on its input x, the router fitted (`profile`: its
    markers, rates and energies, when already taken)."""
    markers, mu, energy = profile or layer_profile(layer, x, cc)
    carving = carve_on_main(markers, mu, energy, cc, plan)
    ffn = filled_ffn(cfg, moe_spec(cfg, cc, plan), slices_for(layer, carving), layer.mlp.gate[...].dtype)
    fit_layer(ffn, x, cc, mesh, plan.active)
    return ffn


class ErrorStep:
    """The layer pass's step of the stream errors: carve layer i to every candidate on its
    FFN input and record each one's stream error; the stream goes on through the dense FFN,
    or with `carry` (a candidate's index) through that candidate's carving, kept in
    `carried`, and with `below` the carving of the candidate below it kept in `lower` (a
    resumed layer, its row already measured, is carved to those alone)."""

    def __init__(self, cfg, cc: ConvertConfig, candidates, mesh, measured: Measured, carry: int | None = None,
                 below: bool = False):
        self.cfg, self.cc, self.candidates, self.mesh = cfg, cc, candidates, mesh
        self.rows, self.on_row = [list(r) for r in measured.errors], measured.on_error
        self.carry, self.carried = carry, []
        self.below, self.lower = below and carry is not None and carry > 0, []

    def __call__(self, inputs: LayerInput) -> nnx.Module:
        layer, x = inputs.layer, inputs.ffn_input
        kept = [] if self.carry is None else [self.carry - 1, self.carry] if self.below else [self.carry]
        if inputs.index < len(self.rows):
            profile = layer_profile(layer, x, self.cc) if kept else None
            carvings = {k: carved_candidate(self.cfg, layer, x, self.cc, self.candidates[k], self.mesh, profile)
                        for k in kept}
        else:
            dense = inputs.stream_after(layer.mlp, self.mesh)
            profile = layer_profile(layer, x, self.cc)
            row, carvings = [], {}
            for k, plan in enumerate(self.candidates):
                if plan is None:  # the dense FFN kept
                    row.append(0.0)
                    continue
                carved = carved_candidate(self.cfg, layer, x, self.cc, plan, self.mesh, profile)
                row.append(stream_error(inputs.stream_after(carved, self.mesh), dense))
                if k in kept:
                    carvings[k] = carved
            self.rows.append(row)
            if self.on_row is not None:
                self.on_row(inputs.index, row)
        if self.carry is None:
            return layer.mlp
        self.carried.append(carvings[self.carry])
        if self.below:
            self.lower.append(carvings[self.carry - 1])
        return carvings[self.carry]


def pass_nll(outer, layers, tokens, mesh, on_layer) -> float:
    """Mean NLL of `tokens` through the dense model (`outer`: embedding, final norm, head;
    `layers` in order), each layer's FFN what `on_layer` returns."""
    h, rope = start_pass(outer, tokens, mesh)
    return stream_nll(outer, layer_pass(layers, h, rope, mesh, on_layer, progress=False), tokens, mesh)


def measure(outer, layers, calib: np.ndarray, cc: ConvertConfig, candidates, *, measure_by: str = "marginal",
            uniform: int | None = None, measured: Measured | None = None) -> Sensitivity:
    """Each layer's stream error at each of `candidates` (None: the dense FFN) and, unless
    `measure_by` is "stream", each layer's loss gain, on the calibration windows `calib`
    [N, T]. "marginal" measures both on the model carved to candidate `uniform` (the
    budget's uniform shape). `outer`: the dense model (its layers, if any, unused); `layers`:
    a re-iterable of its decoder layers in order (a streamed job reads each when a pass
    reaches it)."""
    measured = measured or Measured()
    calib = np.asarray(calib, np.int32)
    if measure_by == "marginal" and uniform is None:
        raise ValueError("the marginal damage needs `uniform`, the candidate it is measured at")
    carry = uniform if measure_by == "marginal" and candidates[uniform] is not None else None
    below = carry is not None and carry > 0  # a shape below the operating point: its rise measured
    n = len(layers)
    if (len(measured.errors) == n and (measure_by == "stream" or len(measured.gains) == n)
            and (not below or len(measured.rises) == n)):
        errors, step = np.asarray(measured.errors, np.float64), None  # a resume with all measured
    else:
        mesh = conversion_mesh(cc, calib.shape[0], measured.devices)
        h, rope = start_pass(outer, calib, mesh)
        step = ErrorStep(outer.config, cc, candidates, mesh, measured, carry, below)
        layer_pass(layers, h, rope, mesh, step, desc="measuring each layer's stream error",
                   progress=measured.progress)
        errors = np.asarray(step.rows, np.float64)
    if measure_by == "stream":
        return Sensitivity(errors, None)
    if measure_by == "loss":
        gains = loss_gains(outer, layers, calib[:LOSS_WINDOWS], cc, candidates[REFERENCE], len(errors), measured)
        return Sensitivity(errors, gains)
    if carry is None:  # the uniform shape is the dense model: nothing to carve
        return Sensitivity(errors, np.ones(len(errors)))
    drops, rises = marginal_losses(outer, layers, calib[:LOSS_WINDOWS], cc, step, measured)
    return Sensitivity(errors, np.maximum(drops, FLOOR) / np.maximum(errors[:, carry], 1e-30),
                       rises if below else None, carry)


def marginal_losses(outer, layers, tokens, cc, step: ErrorStep | None,
                    measured: Measured) -> tuple[np.ndarray, np.ndarray]:
    """For each layer l, inside the model whose FFNs are `step.carried`: the drop d[l] of
    the loss on `tokens` when layer l alone gets its dense FFN back, and (with `step.lower`)
    the rise r[l] when layer l alone takes the carving below: what moving layer l up or down
    costs where the model runs. Saved (and resumed) through `measured`'s gains and rises."""
    drops, rises = list(measured.gains), list(measured.rises)
    lower = [] if step is None else step.lower
    todo = [("drop", i) for i in range(len(drops), len(layers))]
    todo += [("rise", i) for i in range(len(rises), len(layers))] if lower else []
    if not todo:
        return np.asarray(drops, np.float64), np.asarray(rises, np.float64)
    carried = step.carried
    mesh = conversion_mesh(cc, tokens.shape[0], measured.devices)
    carved = pass_nll(outer, layers, tokens, mesh, lambda inputs: carried[inputs.index])
    for what, index in tqdm(todo, desc="measuring each layer's marginal loss", disable=not measured.progress):
        def swapped(inputs, what=what, index=index):
            if inputs.index != index:
                return carried[inputs.index]
            return inputs.layer.mlp if what == "drop" else lower[index]
        loss = pass_nll(outer, layers, tokens, mesh, swapped)
        if what == "drop":
            drops.append(carved - loss)
            if measured.on_gain is not None:
                measured.on_gain(index, drops[-1])
        else:
            rises.append(loss - carved)
            if measured.on_rise is not None:
                measured.on_rise(index, rises[-1])
    return np.asarray(drops, np.float64), np.asarray(rises, np.float64)


def loss_gains(outer, layers, tokens, cc, plan, num_layers: int, measured: Measured) -> np.ndarray:
    """g[l] = max(loss with layer l alone carved to `plan` - dense loss, FLOOR) / that
    carving's stream error, both on `tokens` (the layer carved on them, too)."""
    cfg, gains = outer.config, list(measured.gains)
    if len(gains) == num_layers:
        return np.asarray(gains, np.float64)
    mesh = conversion_mesh(cc, tokens.shape[0], measured.devices)
    dense = pass_nll(outer, layers, tokens, mesh, lambda inputs: inputs.layer.mlp)
    for index in tqdm(range(len(gains), num_layers), desc="measuring each layer's loss gain",
                      disable=not measured.progress):
        error = []

        def carve_one(inputs, index=index):
            if inputs.index != index:
                return inputs.layer.mlp
            ffn = carved_candidate(cfg, inputs.layer, inputs.ffn_input, cc, plan, mesh)
            error.append(stream_error(inputs.run(ffn, mesh), inputs.stream_after(inputs.layer.mlp, mesh)))
            return ffn

        rise = pass_nll(outer, layers, tokens, mesh, carve_one) - dense
        gains.append(max(rise, FLOOR) / max(error[0], 1e-30))
        if measured.on_gain is not None:
            measured.on_gain(index, gains[-1])
    return np.asarray(gains, np.float64)


def measure_damage(model, calib: np.ndarray, cc: ConvertConfig, budget, *,
                   measured: Measured | None = None) -> Sensitivity:
    """Each layer's sensitivity to each of `budget`'s candidate shapes on the calibration
    windows `calib` [N, T] (`Sensitivity.damage()` is what the allocation minimises); the
    streamed job's twin is `cmoe_jax.methods.cmoe.streamed.measure_streamed`."""
    return measure(model, model.layers, calib, cc, budget.candidates(), measure_by=budget.measure_by,
                   uniform=budget.nearest_uniform(), measured=measured)



"""How much carving each layer to each candidate shape costs the model (`--active F`).

Two measurements, both on the dense model's own stream:

- **stream error** e[l, k]: carve layer l to candidate k on its FFN input (the conversion's
  profile, carving and router fit) and take ||h_moe - h_dense||^2 / ||h_dense||^2 of the
  residual stream after the layer, over all calibration tokens: one pass, every candidate.
- **loss gain** g[l]: the rise of the model's next-token loss on a few calibration windows
  when layer l alone is carved to the reference candidate, per unit of its stream error.
  The same stream error costs the loss very differently at different depths (the stream
  grows, later layers see it through fewer layers); one pass per layer, one shape each.

The damage is g[l] * e[l, k] ("loss", the default: the better allocation measured at 25% and
75% active, see docs/methods/cmoe.md) or e[l, k] alone ("stream").
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
from cmoe_jax.methods.cmoe.router_fit import fit_router
from cmoe_jax.models.ffn import filled_ffn
from cmoe_jax.calibration_pass.layer_pass import LayerInput, layer_pass, start_pass, stream_nll

MEASURES = ("loss", "stream")
REFERENCE = 1  # the candidate whose loss rise calibrates a layer's errors: S1A1E8 with 8 experts
LOSS_WINDOWS = 2  # calibration windows the loss is measured on
FLOOR = 1e-9  # least loss rise counted: no layer is free to carve


@dataclasses.dataclass
class Measured:
    """How a measurement runs: what was measured before (a resume: stream-error rows and
    gains of the first layers), the callbacks that save each new row and gain, the devices
    and whether to show progress."""

    errors: list = dataclasses.field(default_factory=list)
    gains: list = dataclasses.field(default_factory=list)
    on_error: Callable[[int, list], None] | None = None
    on_gain: Callable[[int, float], None] | None = None
    devices: list | None = None
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class Sensitivity:
    errors: np.ndarray  # [L, K] stream error of each layer at each candidate (dense: 0)
    gains: np.ndarray | None  # [L] loss rise per unit stream error (None: not measured)

    def damage(self, measure_by: str | None = None) -> np.ndarray:
        """The damage table of `measure_by` ("stream", "loss"; None: the one measured)."""
        if measure_by == "stream" or self.gains is None:
            return self.errors
        return self.gains[:, None] * self.errors


def carved_candidate(cfg, layer, x, cc: ConvertConfig, plan, mesh, profile=None) -> nnx.Module:
    """Layer's FFN carved to `plan` on its input x, the router fitted (`profile`: its
    markers, rates and energies, when already taken)."""
    markers, mu, energy = profile or layer_profile(layer, x, cc)
    carving = carve_on_main(markers, mu, energy, cc, plan)
    ffn = filled_ffn(cfg, moe_spec(cfg, cc, plan), slices_for(layer, carving), layer.mlp.gate[...].dtype)
    fit_router(ffn, x, cc, mesh)
    return ffn


class ErrorStep:
    """The layer pass's step of the stream errors: carve layer i to every candidate on its
    dense FFN input, record each one's stream error, hand the dense FFN back (the stream
    stays the dense model's)."""

    def __init__(self, cfg, cc: ConvertConfig, candidates, mesh, measured: Measured):
        self.cfg, self.cc, self.candidates, self.mesh = cfg, cc, candidates, mesh
        self.rows, self.on_row = [list(r) for r in measured.errors], measured.on_error

    def __call__(self, inputs: LayerInput) -> nnx.Module:
        layer, x = inputs.layer, inputs.ffn_input
        if inputs.index < len(self.rows):
            return layer.mlp
        dense = inputs.stream_after(layer.mlp, self.mesh)
        profile = layer_profile(layer, x, self.cc)
        row = [0.0 if plan is None else  # the dense FFN kept
               stream_error(inputs, carved_candidate(self.cfg, layer, x, self.cc, plan, self.mesh, profile),
                            dense, self.mesh)
               for plan in self.candidates]
        self.rows.append(row)
        if self.on_row is not None:
            self.on_row(inputs.index, row)
        return layer.mlp


def pass_nll(outer, layers, tokens, mesh, on_layer) -> float:
    """Mean NLL of `tokens` through the dense model (`outer`: embedding, final norm, head;
    `layers` in order), each layer's FFN what `on_layer` returns."""
    h, rope = start_pass(outer, tokens, mesh)
    return stream_nll(outer, layer_pass(layers, h, rope, mesh, on_layer, progress=False), tokens, mesh)


def measure(outer, layers, calib: np.ndarray, cc: ConvertConfig, candidates, *, measure_by: str = "loss",
            measured: Measured | None = None) -> Sensitivity:
    """Each layer's stream error at each of `candidates` (None: the dense FFN) and, with
    `measure_by` "loss", each layer's loss gain, on the calibration windows `calib` [N, T].
    `outer`: the dense model (its layers, if any, unused); `layers`: a re-iterable of its
    decoder layers in order (a streamed job reads each when a pass reaches it)."""
    measured = measured or Measured()
    calib = np.asarray(calib, np.int32)
    mesh = conversion_mesh(cc, calib.shape[0], measured.devices)
    h, rope = start_pass(outer, calib, mesh)
    step = ErrorStep(outer.config, cc, candidates, mesh, measured)
    layer_pass(layers, h, rope, mesh, step, desc="measuring each layer's stream error",
               progress=measured.progress)
    errors = np.asarray(step.rows, np.float64)
    if measure_by == "stream":
        return Sensitivity(errors, None)
    gains = loss_gains(outer, layers, calib[:LOSS_WINDOWS], cc, candidates[REFERENCE], len(errors), measured)
    return Sensitivity(errors, gains)


def loss_gains(outer, layers, tokens, cc, plan, num_layers: int, measured: Measured) -> np.ndarray:
    """g[l] = max(loss with layer l alone carved to `plan` - dense loss, FLOOR) / that
    carving's stream error, both on `tokens` (the layer carved on them, too)."""
    mesh = conversion_mesh(cc, tokens.shape[0], measured.devices)
    cfg, gains = outer.config, list(measured.gains)
    dense = pass_nll(outer, layers, tokens, mesh, lambda inputs: inputs.layer.mlp)
    for index in tqdm(range(len(gains), num_layers), desc="measuring each layer's loss gain",
                      disable=not measured.progress):
        error = []

        def carve_one(inputs, index=index):
            if inputs.index != index:
                return inputs.layer.mlp
            ffn = carved_candidate(cfg, inputs.layer, inputs.ffn_input, cc, plan, mesh)
            error.append(stream_error(inputs, ffn, inputs.stream_after(inputs.layer.mlp, mesh), mesh))
            return ffn

        rise = pass_nll(outer, layers, tokens, mesh, carve_one) - dense
        gains.append(max(rise, FLOOR) / max(error[0], 1e-30))
        if measured.on_gain is not None:
            measured.on_gain(index, gains[-1])
    return np.asarray(gains, np.float64)

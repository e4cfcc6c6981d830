"""CMoE conversion streamed from the checkpoint (`cmoe_jax.methods.streamed_pass`): one
decoder layer in memory at a time, converted by the same `LayerConverter` as in memory. With
a budget (`--active F`) a first streamed pass measures each layer's damage at every candidate
shape (`measure_streamed`; the marginal damage also holds each layer's uniform carving, F
of the FFN weights, until its loss passes end), then the conversion reads the layers again.
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from cmoe_jax.methods.cmoe.budget import Budget
from cmoe_jax.methods.cmoe.sensitivity import Measured, Sensitivity, measure
from cmoe_jax.methods.cmoe.config import ConvertConfig
from cmoe_jax.methods.cmoe.convert import (LayerConverter, LayerRecord, carved_plans, conversion_mesh, moe_spec,
                                           validate)
from cmoe_jax.methods.streamed_pass import PER_LAYER, Streamed, StreamedLayers, converted_layer_state, streamed_pass
from cmoe_jax.loading.load import load_outer
from cmoe_jax.models import ModelConfig


def measure_streamed(model: Streamed, calib: np.ndarray, cc: ConvertConfig, budget: Budget, *,
                     measured: Measured | None = None) -> Sensitivity:
    """`measure_damage` of the dense model in `model.source`, its layers read one at a time
    (every pass reads them again): the same figures as on the loaded model (same steps, same
    order), the embedding, head and one dense layer in memory. Writes nothing to `model.out`."""
    source, cfg, _ = model
    measured = measured or Measured()
    mesh = conversion_mesh(cc, np.asarray(calib).shape[0], measured.devices)
    outer = load_outer(source, cfg, dtype=jnp.float32, mesh=mesh)
    return measure(outer, StreamedLayers(model, mesh), calib, cc, budget.candidates(), measure_by=budget.measure_by,
                   uniform=budget.nearest_uniform(), measured=measured)


def convert_streamed(model: Streamed, calib: np.ndarray, cc: ConvertConfig, *, devices=None,
                     progress: bool = True, done: list[LayerRecord] | None = None,
                     on_layer: Callable[[int, LayerRecord], None] | None = None,
                     expert_parallel: int = 1) -> tuple[ModelConfig, list[LayerRecord]]:
    """Convert the dense model in `model.source` layer by layer, writing its state into
    `model.out` (`out/state/rest`, `out/state/layer_NNNN`) -> (converted config, records).

    The result equals `convert_model` on the loaded model (same steps, same order); the
    caller adds the manifest (with `"state_layout": PER_LAYER`) to make `out` loadable.
    `done`, `on_layer`, `expert_parallel`: as in `convert_model`.
    """
    cfg = model.config
    calib = np.asarray(calib, np.int32)
    validate(cfg, calib, cc)
    mesh = conversion_mesh(cc, calib.shape[0], devices, expert_parallel, carved_plans(cfg, cc))
    cfg_moe = cfg.with_moe_layers([moe_spec(cfg, cc, p) for p in cc.layer_shapes(cfg.num_layers)])
    step = LayerConverter(cfg, cc, mesh, done or (), on_layer)
    streamed_pass(model, calib, mesh, step, lambda index: cfg_moe,
                  desc=f"converting to {cc.label} (streamed)", progress=progress)
    return cfg_moe, step.records


__all__ = ["PER_LAYER", "Streamed", "convert_streamed", "converted_layer_state", "measure_streamed"]

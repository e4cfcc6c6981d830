"""CMoE conversion streamed from the checkpoint: one decoder layer in memory at a time.

`convert_model` needs the whole dense model in memory; a 70B model does not fit one host.
Here each layer's weights are read from the checkpoint (safetensors shards, GGUF) only when
the calibration stream reaches it, converted by the same `LayerConverter`, written to the
output as its own checkpoint piece and dropped. Peak host memory is about one dense layer
(plus its carved copy) and one layer's calibration activations, whatever the depth; the
embedding and LM head are read once, written, and dropped before the first layer. With a
budget (`--active F`) a first streamed pass measures each layer's damage at every candidate
shape (`measure_streamed`; the marginal damage also holds each layer's uniform carving, F
of the FFN weights, until its loss passes end), then the conversion reads the layers again.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from cmoe_jax.checkpoint import PER_LAYER, layer_part, save_state_part, without_layers
from cmoe_jax.methods.cmoe.budget import Budget
from cmoe_jax.methods.cmoe.sensitivity import Measured, Sensitivity, measure
from cmoe_jax.methods.cmoe.config import ConvertConfig
from cmoe_jax.methods.cmoe.convert import (LayerConverter, LayerRecord, carved_plans, conversion_mesh, moe_spec,
                                           validate)
from cmoe_jax.loading.load import load_layer, load_outer
from cmoe_jax.loading.sources import TensorSource
from cmoe_jax.models import DecoderLayer, ModelConfig
from cmoe_jax.calibration_pass.layer_pass import layer_pass, start_pass


def converted_layer_state(cfg_moe: ModelConfig, index: int, dense_layer, ffn) -> nnx.State:
    """The state of converted layer `index`: the dense layer's attention and norms, the
    carved MoE FFN in place of its SwiGLU."""
    abstract = nnx.eval_shape(lambda: DecoderLayer(cfg_moe, index, dtype=jnp.float32,
                                                   rngs=nnx.Rngs(0)))
    values = nnx.to_pure_dict(nnx.state(dense_layer))
    values["mlp"] = nnx.to_pure_dict(nnx.state(ffn))
    state = nnx.state(abstract)
    nnx.replace_by_pure_dict(state, values)
    return state


class Streamed(NamedTuple):
    """A dense checkpoint read one layer at a time (`source`, of `config`), and the directory
    its conversion is written into."""

    source: TensorSource
    config: ModelConfig
    out: Path


class _Layers:
    """The dense layers of `model`, each read only when the pass reaches it."""

    def __init__(self, model: Streamed, mesh):
        self.model, self.mesh = model, mesh

    def __len__(self) -> int:
        return self.model.config.num_layers

    def __iter__(self):
        for i in range(len(self)):
            yield load_layer(self.model.source, self.model.config, i, dtype=jnp.float32, mesh=self.mesh)


def measure_streamed(model: Streamed, calib: np.ndarray, cc: ConvertConfig, budget: Budget, *,
                     measured: Measured | None = None) -> Sensitivity:
    """`measure_damage` of the dense model in `model.source`, its layers read one at a time
    (every pass reads them again): the same figures as on the loaded model (same steps, same
    order), the embedding, head and one dense layer in memory. Writes nothing to `model.out`."""
    source, cfg, _ = model
    measured = measured or Measured()
    mesh = conversion_mesh(cc, np.asarray(calib).shape[0], measured.devices)
    outer = load_outer(source, cfg, dtype=jnp.float32, mesh=mesh)
    return measure(outer, _Layers(model, mesh), calib, cc, budget.candidates(), measure_by=budget.measure_by,
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
    source, cfg, out = model
    calib = np.asarray(calib, np.int32)
    validate(cfg, calib, cc)
    mesh = conversion_mesh(cc, calib.shape[0], devices, expert_parallel, carved_plans(cfg, cc))
    outer = load_outer(source, cfg, dtype=jnp.float32, mesh=mesh)
    source.release()  # the file's pages go before the save's buffers arrive
    save_state_part(out, "rest", without_layers(nnx.state(outer)))
    h, rope = start_pass(outer, calib, mesh)
    del outer
    cfg_moe = cfg.with_moe_layers([moe_spec(cfg, cc, p) for p in cc.layer_shapes(cfg.num_layers)])
    step = LayerConverter(cfg, cc, mesh, done or (), on_layer)

    def save(inputs, load):
        state = converted_layer_state(cfg_moe, inputs.index, inputs.layer, inputs.ffn)
        inputs.layer = inputs.ffn = None  # the dense FFN goes before the save's buffers arrive
        save_state_part(out, layer_part(inputs.index), state)
        del state
        source.release()
        step.finish(inputs, load)

    layer_pass(_Layers(model, mesh), h, rope, mesh, step, after_layer=save,
               desc=f"converting to {cc.label} (streamed)", progress=progress)
    return cfg_moe, step.records


__all__ = ["PER_LAYER", "Streamed", "convert_streamed", "converted_layer_state", "measure_streamed"]

"""A conversion streamed from the checkpoint: one decoder layer in memory at a time.

A conversion of a loaded model needs the whole dense model in memory; a 70B model does not
fit one host. Here each layer's weights are read from the checkpoint (safetensors shards,
GGUF) only when the calibration stream reaches it, converted by a method's own step (the one
its in-memory conversion runs), written to the output as its own checkpoint piece and
dropped. Peak host memory is about one dense layer (plus its converted copy) and one
layer's calibration activations, whatever the depth; the embedding and LM head are read
once, written, and dropped before the first layer. Every method that converts a dense
model layer by layer streams through `streamed_pass`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from cmoe_jax.calibration_pass.layer_pass import LayerStep, layer_pass, start_pass
from cmoe_jax.checkpoint import (PER_LAYER, layer_part, save_converted, save_state_part, without_layers,
                                 write_manifest)
from cmoe_jax.loading import open_source
from cmoe_jax.loading.load import load_layer, load_outer
from cmoe_jax.loading.sources import TensorSource
from cmoe_jax.models import DecoderLayer, ModelConfig


class Streamed(NamedTuple):
    """A dense checkpoint read one layer at a time (`source`, of `config`), and the directory
    its conversion is written into."""

    source: TensorSource
    config: ModelConfig
    out: Path

    @classmethod
    def of_job(cls, run) -> "Streamed":
        """A conversion job's source, read layer by layer into its staged output `run.final`."""
        source = run.source
        return cls(source.source or open_source(source.path), source.config, run.final)


class StreamedLayers:
    """The dense layers of `model`, each read only when the pass reaches it."""

    def __init__(self, model: Streamed, mesh):
        self.model, self.mesh = model, mesh

    def __len__(self) -> int:
        return self.model.config.num_layers

    def __iter__(self):
        for i in range(len(self)):
            yield load_layer(self.model.source, self.model.config, i, dtype=jnp.float32, mesh=self.mesh)


def converted_layer_state(cfg_moe: ModelConfig, index: int, dense_layer, ffn) -> nnx.State:
    """The state of converted layer `index`: the dense layer's attention and norms, the
    converted FFN in place of its own."""
    abstract = nnx.eval_shape(lambda: DecoderLayer(cfg_moe, index, dtype=jnp.float32,
                                                   rngs=nnx.Rngs(0)))
    values = nnx.to_pure_dict(nnx.state(dense_layer))
    values["mlp"] = nnx.to_pure_dict(nnx.state(ffn))
    state = nnx.state(abstract)
    nnx.replace_by_pure_dict(state, values)
    return state


def streamed_pass(model: Streamed, calib: np.ndarray, mesh, step: LayerStep,
                  layer_config: Callable[[int], ModelConfig], *, desc: str, progress: bool = True) -> None:
    """The layer pass of `step` over the dense model in `model.source`, each converted layer
    written into `model.out` (`out/state/rest`, `out/state/layer_NNNN`) as it is made, then
    handed to `step.finish`. `layer_config(i)`: a converted config whose layer i has the FFN
    the step made for it (called once that layer is made). The caller writes the manifest
    (with `"state_layout": PER_LAYER`) that makes `out` loadable."""
    source, cfg, out = model
    outer = load_outer(source, cfg, dtype=jnp.float32, mesh=mesh)
    source.release()  # the file's pages go before the save's buffers arrive
    save_state_part(out, "rest", without_layers(nnx.state(outer)))
    h, rope = start_pass(outer, calib, mesh)
    del outer

    def save(inputs, load):
        state = converted_layer_state(layer_config(inputs.index), inputs.index, inputs.layer, inputs.ffn)
        inputs.layer = inputs.ffn = None  # the dense FFN goes before the save's buffers arrive
        save_state_part(out, layer_part(inputs.index), state)
        del state
        source.release()
        step.finish(inputs, load)

    layer_pass(StreamedLayers(model, mesh), h, rope, mesh, step, after_layer=save, desc=desc, progress=progress)


def save_conversion(out: Path, model, manifest: dict, tokenizer, streamed_config: ModelConfig | None) -> None:
    """Save a finished conversion into `out`: a streamed one (`streamed_config`, its config;
    its layers already written there by `streamed_pass`) gets its manifest, with
    `"state_layout": PER_LAYER`; one made in memory (`model`) is saved whole."""
    if streamed_config is not None:
        write_manifest(out, streamed_config, dict(manifest, state_layout=PER_LAYER), tokenizer)
    else:
        save_converted(model, manifest, out, tokenizer=tokenizer)


__all__ = ["PER_LAYER", "Streamed", "StreamedLayers", "converted_layer_state", "save_conversion", "streamed_pass"]

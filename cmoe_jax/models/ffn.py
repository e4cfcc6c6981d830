"""One FFN builder for every method: a layer spec in, the module out (random or filled).

A method computes the arrays of its FFN (carved slices, woven experts, a sub-expert split)
by parameter name; `filled_ffn` lays them into the module the spec describes without ever
drawing random weights for it, checking every shape.
"""
from __future__ import annotations

from typing import MutableMapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from cmoe_jax.models.config import FFNSpec, ModelConfig
from cmoe_jax.models.layers import SwiGLU
from cmoe_jax.moe import MoEFFN
from cmoe_jax.moe.hierarchical import HierMoEFFN

# Learned gates, load-balancing biases, the skipped experts' compensation and the routing
# threshold start at zero in a fresh module; a method that does not set them leaves them
# there. Every other parameter must be given.
ZERO_START = frozenset({"u", "router_bias", "top_u", "top_bias", "skip_down", "router_threshold"})


def make_ffn(cfg: ModelConfig, spec: FFNSpec | None, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
    """The FFN of one decoder layer: dense SwiGLU (`spec` None), MoE, or hierarchical MoE."""
    if spec is None:
        return SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs,
                      activation=cfg.activation)
    layer = HierMoEFFN if spec.sub_experts else MoEFFN  # hierarchical: experts carved into sub-experts
    return layer(spec, d_model=cfg.hidden_size, activation=cfg.activation, dtype=dtype,
                 param_dtype=dtype, rngs=rngs)


def filled_ffn(cfg: ModelConfig, spec: FFNSpec | None, values: MutableMapping[str, np.ndarray],
               dtype) -> nnx.Module:
    """The FFN of `spec` holding `values` (parameter name -> array, cast to the variable's
    dtype); a missing name other than a zero-start gate or bias is an error. Consumes
    `values`: each array is dropped once placed, so building needs about one tensor more
    than the layer itself."""
    ffn = nnx.eval_shape(lambda: make_ffn(cfg, spec, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(ffn)
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        name, target = path[-1], var.get_value()
        if name in values:
            value = np.asarray(values.pop(name))
        elif name in ZERO_START:
            value = np.zeros(target.shape, np.float32)
        else:
            raise ValueError(f"no value given for the FFN parameter {name!r}")
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{name}: computed shape {value.shape} != layer shape {target.shape}")
        var.set_value(jnp.asarray(value, dtype=target.dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))

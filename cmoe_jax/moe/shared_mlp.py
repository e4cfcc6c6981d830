"""The always-on shared MLP of an MoE layer, `down(act(x W_gate) * (x W_up))`, optionally
scaled by `sigmoid(x W_sg)` (Qwen2-MoE's gated shared expert)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cmoe_jax.lora_variables import project
from cmoe_jax.moe.activations import glu_activation

NAMES = ("shared_gate", "shared_up", "shared_down", "shared_gate_kernel")


def make_shared_mlp(layer, param, d_model: int, width: int, gated: bool) -> None:
    """Create `shared_gate/shared_up [d, S]`, `shared_down [S, d]` (and the gate kernel
    `shared_gate_kernel [d, 1]` when `gated`) on `layer`; nothing for width 0."""
    if width > 0:
        layer.shared_gate = param(d_model, width, axes=("embed", "mlp"))
        layer.shared_up = param(d_model, width, axes=("embed", "mlp"))
        layer.shared_down = param(width, d_model, axes=("mlp", "embed"))
        if gated:
            layer.shared_gate_kernel = param(d_model, 1, axes=("embed", None))


def shared_mlp(layer, x: jax.Array, key=None) -> jax.Array:
    """The shared MLP of `layer` on tokens `x [T, d]` in the layer's dtype (zeros when it has
    none); adapted weights add their low-rank updates (`cmoe_jax.lora_variables`)."""
    if layer.spec.shared_width == 0:
        return jnp.zeros_like(x)
    proj = lambda name, inp: project(layer, name, inp, getattr(layer, name)[...].astype(layer.dtype), key)  # noqa: E731
    act = glu_activation(layer.activation)
    out = proj("shared_down", act(proj("shared_gate", x)) * proj("shared_up", x))
    if layer.spec.shared_gated:
        out = out * jax.nn.sigmoid(x @ layer.shared_gate_kernel[...].astype(layer.dtype))
    return out

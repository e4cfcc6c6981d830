"""`carve_ffn`: one dense SwiGLU FFN of your own into a filled `MoEFFN`, in one call.

The same steps as the model conversion (`convert_model`), on one FFN and one process:
profile the FFN on calibration inputs (`profile_layer`), carve its neurons
(`carve_profiled`: shared neurons, balanced K-means, router neurons), slice the weights
(`slice_ffn`) into the conversion's MoE layer (`moe_spec`, `filled_ffn`) and fit the
router's per-expert score scales, the gate scales and the down projections (`fit_layer`).

Example::

    moe = carve_ffn(w_gate, w_up, w_down, x_calib, "S1A2E8", activation="silu")   # x_calib [..., d]
    y = moe(x)                                                 # MoEFFN, cmoe router
"""
from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import numpy as np

from cmoe_jax.errors import InputError
from cmoe_jax.methods.cmoe.carve import LayerCarving, slice_ffn
from cmoe_jax.methods.cmoe.config import ConversionError, ConvertConfig
from cmoe_jax.methods.cmoe.convert import carve_profiled, check_router, conversion_mesh, moe_spec
from cmoe_jax.methods.cmoe.plan import MoEPlan
from cmoe_jax.methods.cmoe.layer_fit import fit_layer
from cmoe_jax.models import ModelConfig
from cmoe_jax.models.ffn import filled_ffn
from cmoe_jax.moe import MoEFFN, resolve_backend
from cmoe_jax.moe.activations import ACTIVATIONS
from cmoe_jax.calibration_pass.markers import profile_layer


def _ffn_config(d: int, d_h: int, activation: str) -> ModelConfig:
    """A one-layer model config that only names the FFN's widths and activation (what
    `moe_spec` and `filled_ffn` read)."""
    return ModelConfig(model_type="ffn", vocab_size=1, hidden_size=d, intermediate_size=d_h,
                       num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1, activation=activation)


def _check(w_gate, w_up, w_down, x) -> tuple[int, int]:
    shapes = tuple(getattr(w, "shape", None) for w in (w_gate, w_up, w_down))
    if any(s is None or len(s) != 2 for s in shapes):
        raise InputError(f"w_gate, w_up, w_down must be 2-D arrays, got shapes {shapes}")
    d, d_h = shapes[0]
    if shapes[1] != (d, d_h) or shapes[2] != (d_h, d):
        raise InputError(f"w_gate {shapes[0]}, w_up {shapes[1]}, w_down {shapes[2]} are not "
                         "[d, d_h], [d, d_h], [d_h, d] (JAX layout: [in, out])")
    xs = getattr(x, "shape", None)
    if xs is None or len(xs) < 2 or xs[-1] != d:
        raise InputError(f"calibration_inputs must be [..., d={d}] (tokens by width), got shape {xs}")
    if int(np.prod(xs[:-1])) < 1:
        raise InputError("calibration_inputs hold no token")
    return d, d_h


def _check_calibration(x, plan: MoEPlan) -> None:
    """Finite inputs, and at least one token per expert: the gate scales are a least-squares
    fit over the tokens, with one unknown per expert."""
    tokens = int(np.prod(np.shape(x)[:-1]))
    if tokens < plan.total:
        raise InputError(f"calibration_inputs hold {tokens} tokens, fewer than the plan's "
                         f"{plan.total} experts: give at least one token per expert (a few thousand carve well)")
    if not bool(jnp.isfinite(jnp.asarray(x)).all()):
        raise InputError("calibration_inputs hold NaN or infinite values: pass the FFN's finite inputs")


def carve_ffn(w_gate, w_up, w_down, calibration_inputs, plan: str | MoEPlan, *,
              activation: str, dtype=None, backend="auto", return_carving: bool = False,
              **options) -> MoEFFN | tuple[MoEFFN, LayerCarving]:
    """A `MoEFFN` (router "cmoe") carved from the dense GLU FFN
    `down(act(x w_gate) * (x w_up))`.

    Args:
      w_gate, w_up: `[d, d_h]`; w_down: `[d_h, d]` (numpy or JAX, any float dtype).
      calibration_inputs: FFN inputs `[..., d]` the neurons are profiled on (a few thousand
        tokens of your model's hidden states at this FFN).
      plan: "SxAyEz" (x shared experts fused into one shared MLP, y routed experts active of
        z experts in all, expert width d_h / z) or a `MoEPlan`.
      activation: the FFN's GLU activation `act` ("silu" for Llama/Qwen, "gelu_tanh" for
        Gemma: `cmoe_jax.moe.activations`); the profile, the experts and the router use it.
      dtype: parameter and compute dtype of the layer (default: w_gate's).
      backend: grouped-matmul backend of the layer (`cmoe_jax.moe.gmm`).
      return_carving: also return the `LayerCarving` (which neurons went where).
      **options: the conversion's `ConvertConfig` fields: k_act, normalize, kmeans_iters,
        router_neurons, router_scale, router_fit_tokens, shared_by, router_reps, gate_fit,
        down_fit, down_fit_tokens, skip_compensation, routing.

    With every routed expert active (`layer.top_k = layer.num_experts`), `gate_fit=False` and
    `down_fit=0` the layer equals the dense FFN: the carving is a permutation of its neurons and the gates
    are 1 (fitted gate scales are fitted for the plan's top-k, not for every expert active).
    """
    d, d_h = _check(w_gate, w_up, w_down, calibration_inputs)
    plan = plan if isinstance(plan, MoEPlan) else MoEPlan.parse(plan, "plan")
    _check_calibration(calibration_inputs, plan)
    unknown = set(options) - {f.name for f in dataclasses.fields(ConvertConfig)} | (
        {"plan"} & set(options))
    if unknown:
        raise InputError(f"unknown carve_ffn option(s) {sorted(unknown)}; the options are the "
                         "fields of ConvertConfig")
    cc = ConvertConfig(plan=plan, **options)
    plan.validate(d_h, cc.k_act)
    if activation not in ACTIVATIONS:
        raise InputError(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    cfg = _ffn_config(d, d_h, activation)
    try:
        check_router(cfg, cc)
    except ConversionError as e:  # name the keyword, not the CLI flag
        raise InputError(re.sub(r"--([a-z-]+)", lambda m: m[1].replace("-", "_"), str(e))) from e
    if not callable(backend):
        resolve_backend(backend)
    dtype = jnp.dtype(dtype or getattr(w_gate, "dtype", jnp.float32))
    x = jnp.asarray(calibration_inputs, jnp.float32).reshape(-1, d)
    markers, mu, energy = profile_layer(x, w_gate, w_up, w_down, k_act=cc.k_act,
                                        normalize=cc.normalize, activation=activation)
    carving = carve_profiled(np.asarray(markers), np.asarray(mu), np.asarray(energy), cc, cc.plan)
    weights = [np.asarray(w, np.float32) for w in (w_gate, w_up, w_down)]
    layer = filled_ffn(cfg, moe_spec(cfg, cc, cc.plan), slice_ffn(*weights, carving), dtype)
    layer.backend = backend
    fit_layer(layer, x[None], cc, conversion_mesh(cc, 1), cc.plan.active)
    return (layer, carving) if return_carving else layer

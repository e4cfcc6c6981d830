"""Layer-wise reconstruction (`train --recover layerwise`): each converted FFN's LoRA
adapters and router scales u fitted, one layer at a time, to reproduce the dense FFN's
output on calibration inputs, as pruning methods of the SparseGPT family reconstruct each
layer. No gradient crosses a layer boundary, so the cost is a few hundred small
full-batch steps per layer rather than backward passes through the whole network.

The calibration windows run through the student with `cmoe_jax.calibration_pass.layer_pass`:
layer l's FFN sees the stream that the already-recovered layers before it produce, and is
fitted to minimise ||FFN_l(x) - FFN_dense_l(x)||^2 / ||FFN_dense_l(x)||^2 on it (the
relative error `benchmarks/ffn_layer_error.py` reports). The fitted adapters are merged
into the student's weights before any global training (`--distill` or the LM loss) starts.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from cmoe_jax.errors import TrainError
from cmoe_jax.lora_variables import attach
from cmoe_jax.models.stack import each_layer
from cmoe_jax.moe import MoELayer
from cmoe_jax.moe.params import like
from cmoe_jax.calibration_pass.layer_pass import (calibration_mesh, layer_pass, replicate,
                                                  start_pass)
from cmoe_jax.models.adapters import trains_router
from cmoe_jax.train.lora_targets import LoRAConfig, init_adapters


@dataclasses.dataclass(frozen=True)
class RecoverConfig:
    samples: int = 16  # calibration windows (the first of the training windows)
    steps: int = 200  # full-batch Adam steps per layer
    lr: float = 1e-3

    def validate(self, train_samples: int) -> None:
        if not 1 <= self.samples <= train_samples:
            raise TrainError(f"--recover-samples must be in 1..--samples ({train_samples}), "
                             f"got {self.samples}")
        if self.steps < 1:
            raise TrainError(f"--recover-steps must be at least 1, got {self.steps}")
        if not self.lr > 0:
            raise TrainError(f"--recover-lr must be positive, got {self.lr}")

    def settings(self) -> dict:
        return {"mode": "layerwise", **dataclasses.asdict(self)}


def _adapted(graphdef, state, params: dict, scale: float):
    ffn = nnx.merge(graphdef, state)
    for name, ab in params["lora"].items():
        attach(ffn, name, ab["a"], ab["b"], scale)
    if "u" in params:
        ffn.u = like(ffn.u, params["u"])
    return ffn


def relative_error(y, y0) -> jax.Array:
    """||y - y0||^2 / ||y0||^2 in float32."""
    y, y0 = y.astype(jnp.float32), y0.astype(jnp.float32)
    return jnp.sum(jnp.square(y - y0)) / jnp.maximum(jnp.sum(jnp.square(y0)), 1e-30)


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, x):
    return nnx.merge(graphdef, state)(x)


def make_fit(cfg: RecoverConfig, scale: float):
    """`fit(graphdef, state, params, x, y) -> (params, error before, error after)`: `cfg.steps`
    Adam steps on one FFN's adapters / u, all in one compiled loop (one compile per distinct
    layer structure)."""
    tx = optax.adam(cfg.lr, b1=0.9, b2=0.95)

    @functools.partial(jax.jit, static_argnums=0)
    def fit(graphdef, state, params, x, y):
        def loss(p):
            return relative_error(_adapted(graphdef, state, p, scale)(x), y)

        def step(_, carry):
            p, opt = carry
            grads = jax.grad(loss)(p)
            updates, opt = tx.update(grads, opt, p)
            return optax.apply_updates(p, updates), opt

        before = loss(params)
        params, _ = jax.lax.fori_loop(0, cfg.steps, step, (params, tx.init(params)))
        return params, before, loss(params)

    return fit


def layerwise_recover(student, teacher, windows: np.ndarray, lora: LoRAConfig,
                      cfg: RecoverConfig, key: jax.Array, *, devices=None,
                      progress: bool = True) -> tuple[dict, dict, list[dict]]:
    """(adapters `{"layers": {i: {"mlp": ...}}}`, router scales `{i: u}`, per-layer records
    `{"layer", "before", "after"}`) fitted layer by layer on `windows [N, T]`; `teacher` is
    the dense model whose FFN outputs are the targets. Non-MoE layers are left as they are."""
    fresh = init_adapters(student, lora, key).get("layers", {})
    moe = [i for i, (layer, _) in enumerate(each_layer(student)) if isinstance(layer.mlp, MoELayer)]
    if not moe:
        raise TrainError("--recover layerwise: the model has no converted (MoE) FFN to recover")
    if not any((fresh.get(str(i), {}).get("mlp")) for i in moe) and not any(
            trains_router(layer.mlp) for layer, _ in each_layer(student)):
        raise TrainError("--recover layerwise fits the FFNs' adapters or router scales: add "
                         "gate_proj/up_proj/down_proj to --targets")
    mesh = calibration_mesh(len(windows), devices)
    dense_layers = teacher.unstacked().layers
    fit = make_fit(cfg, lora.scale)
    adapters, us, records = {"layers": {}}, {}, []

    def on_layer(inputs):
        i, ffn = inputs.index, inputs.layer.mlp
        if i not in moe:
            return ffn
        x = inputs.ffn_input
        y = _apply(*nnx.split(dense_layers[i].mlp), x)
        params = {"lora": fresh.get(str(i), {}).get("mlp", {})}
        if trains_router(ffn):
            params["u"] = jnp.asarray(ffn.u[...], jnp.float32)
        graphdef, state = nnx.split(ffn)
        params, before, after = fit(graphdef, replicate(state, mesh), replicate(params, mesh), x, y)
        if not np.isfinite(after):
            raise TrainError(f"layer {i}: the layer-wise fit diverged (its error became {float(after)}): "
                             "lower --recover-lr")
        params = jax.device_get(params)
        adapters["layers"][str(i)] = {"mlp": params["lora"]}
        if "u" in params:
            us[str(i)] = params["u"]
        records.append({"layer": i, "before": float(before), "after": float(after)})
        return _adapted(graphdef, state, params, lora.scale)

    h, rope = start_pass(student, windows, mesh)
    layer_pass(student.unstacked().layers, h, rope, mesh, on_layer,
               desc="layer-wise recovery", progress=progress)
    return adapters, us, records

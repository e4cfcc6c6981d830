"""Hierarchical CMoE conversion of an in-memory MoE model: every expert of every MoE layer
carved into shared and routed sub-experts (`cmoe_jax.carving.hierarchical`), layer by layer on
the activations the already-converted layers produce, as in the dense pipeline."""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from cmoe_jax.carving import LayerCarving
from cmoe_jax.carving.hierarchical import (HOST_NAMES, TOP_ROUTER_NAMES, ExpertCarving,
                                           carve_moe_layer, random_moe_layer)
from cmoe_jax.convert.pipeline import ConversionError, ConvertConfig, assemble
from cmoe_jax.models import Decoder, FFNSpec, ModelConfig
from cmoe_jax.profiling.layerwise import (calibration_mesh, ffn_residual_step, layer_ffn_input,
                                          replicate, start_pass)

def is_moe(cfg: ModelConfig) -> bool:
    return any(s is not None for s in cfg.moe_layers)


def validate_moe(cfg: ModelConfig, cc: ConvertConfig, min_tokens: int = 32) -> None:
    """Fail before any work on a source or sub-plan that cannot be carved hierarchically."""
    if min_tokens < 1:
        raise ConversionError(f"--min-expert-tokens {min_tokens} must be at least 1")
    specs = [s for s in cfg.moe_layers if s is not None]
    if not specs:
        raise ConversionError("the model has no MoE layer: hierarchical CMoE needs an MoE source")
    for spec in specs:
        if spec.sub_experts:
            raise ConversionError("the model is already hierarchical: carve its source MoE instead")
        if spec.router not in ("linear", "cmoe"):
            raise ConversionError(f"top-level router {spec.router!r} is not supported (linear, cmoe)")
        try:
            cc.plan.validate(spec.expert_width, cc.k_act)
        except ValueError as e:
            raise ConversionError(f"{e} (the per-expert plan S'A'E' splits each expert of width "
                                  f"d_e={spec.expert_width})") from e
        m = spec.expert_width // cc.plan.total
        if not 1 <= cc.router_neurons <= m:
            raise ConversionError(f"--router-neurons {cc.router_neurons} must be between 1 and the "
                                  f"sub-expert width {m}")


def hier_spec(spec: FFNSpec | None, cc: ConvertConfig) -> FFNSpec | None:
    if spec is None:
        return None
    plan = cc.plan
    return dataclasses.replace(spec, expert_width=spec.expert_width // plan.total,
                               sub_experts=plan.total, sub_shared=plan.shared,
                               sub_top_k=plan.active, sub_router_neurons=cc.router_neurons)


@dataclasses.dataclass
class HierLayerRecord:
    """One layer's per-expert carvings (empty for a dense layer), loads and timings."""

    experts: list
    load: np.ndarray
    seconds: dict

    def to_json(self) -> dict:
        return {"experts": [{"shared": e.carving.shared_idx.tolist(), "routed": e.carving.expert_idx.tolist(),
                             "representatives": e.carving.representative_idx.tolist(),
                             "kmeans_iterations": int(e.carving.iterations), "tokens": int(e.tokens),
                             "fallback": bool(e.fallback),
                             "router_scales": None if e.router_scales is None
                             else np.asarray(e.router_scales, np.float64).tolist()}
                            for e in self.experts],
                "load": np.asarray(self.load).tolist(), "seconds": self.seconds}

    @classmethod
    def from_json(cls, d: dict) -> "HierLayerRecord":
        experts = [ExpertCarving(LayerCarving(np.asarray(e["shared"], np.int64),
                                              np.asarray(e["routed"], np.int64),
                                              np.asarray(e["representatives"], np.int64),
                                              e["kmeans_iterations"]), e["tokens"], e["fallback"])
                   for e in d["experts"]]
        return cls(experts, np.asarray(d["load"]), d["seconds"])


@functools.partial(jax.jit, static_argnums=0)
def _top_ids(graphdef, state, x):
    return nnx.merge(graphdef, state).route(x.reshape(-1, x.shape[-1]))[0]


def build_hier_ffn(src, spec: FFNSpec, carved: dict, dtype) -> nnx.Module:
    """A `HierMoEFFN` holding the carved sub-experts and the source's top-level router and
    host shared MLP, unchanged. Consumes `carved` (each array is dropped once placed, so
    building needs about one tensor more than the carved layer)."""
    from cmoe_jax.moe.hierarchical import HierMoEFFN

    values = carved
    for name in (*TOP_ROUTER_NAMES, *HOST_NAMES):
        if hasattr(src, name):
            values[TOP_ROUTER_NAMES.get(name, name)] = np.asarray(getattr(src, name)[...], np.float32)
    ffn = nnx.eval_shape(lambda: HierMoEFFN(
        src.d_model, spec.expert_width, spec.num_experts, spec.top_k, sub_experts=spec.sub_experts,
        sub_shared=spec.sub_shared, sub_top_k=spec.sub_top_k,
        sub_router_neurons=spec.sub_router_neurons, shared_width=spec.shared_width,
        router=spec.router, norm_topk_prob=spec.norm_topk_prob, router_neurons=spec.router_neurons,
        dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(ffn)
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        shape = var.get_value().shape
        value = values.pop(path[-1])
        if tuple(value.shape) != tuple(shape):
            raise AssertionError(f"{path[-1]}: carved shape {value.shape} != layer shape {shape}")
        var.set_value(jnp.asarray(value, dtype=var.get_value().dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def convert_moe_model(model: Decoder, calib: np.ndarray, cc: ConvertConfig, *,
                      min_tokens: int = 32, devices=None,
                      progress: bool = True, done: list | None = None,
                      on_layer: Callable[[int, HierLayerRecord], None] | None = None):
    """Carve every expert of the MoE `model` with the per-expert plan `cc.plan`:
    -> (hierarchical model, [HierLayerRecord]).

    `done`: records of finished layers
    (resume): their carvings are reused, so the result equals an uninterrupted run."""
    cfg = model.config
    validate_moe(cfg, cc, min_tokens)
    calib = np.asarray(calib, np.int32)
    done = list(done or [])
    mesh = calibration_mesh(calib.shape[0], devices)
    h, rope = start_pass(model, calib, mesh)
    records, ffns = [], []
    bar = tqdm(range(cfg.num_layers), desc=f"carving experts ({cc.plan.name} each)", disable=not progress)
    for i in bar:
        layer = model.layers[i]
        h_mid, x, t_attn = layer_ffn_input(layer, i, h, rope, mesh)
        seconds = {"attention": t_attn}
        spec = cfg.ffn_spec(i)
        src = layer.mlp
        if spec is None:
            ffn, experts = src, []
        else:
            t1 = time.perf_counter()
            xf = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
            top_ids = np.asarray(_top_ids(*nnx.split(src), jnp.asarray(xf)))
            weights = {k: np.asarray(getattr(src, k)[...], np.float32)
                       for k in ("expert_gate", "expert_up", "expert_down")}
            carved, experts = carve_moe_layer(xf, top_ids, weights, cc.plan, cc, min_tokens=min_tokens,
                                              done=done[i].experts if i < len(done) else None)
            seconds["carve"] = time.perf_counter() - t1
            ffn = build_hier_ffn(src, hier_spec(spec, cc), carved, model.dtype)
        t2 = time.perf_counter()
        fg, fs = nnx.split(ffn)
        h, load = ffn_residual_step(fg, replicate(fs, mesh), h_mid, x)
        seconds["route_and_forward"] = time.perf_counter() - t2
        record = HierLayerRecord(experts, np.asarray(load), seconds)
        del h_mid, x
        ffns.append(ffn)
        records.append(record)
        if i >= len(done) and on_layer is not None:
            on_layer(i, record)
    cfg_hier = cfg.with_moe_layers([hier_spec(cfg.ffn_spec(i), cc) for i in range(cfg.num_layers)])
    return assemble(model, cfg_hier, ffns), records


def random_hierarchical(model: Decoder, cc: ConvertConfig) -> Decoder:
    """The labelled baseline at the same active width: every expert split into random
    sub-experts with a random sub-router (`random_moe_layer`); no calibration data."""
    cfg = model.config
    validate_moe(cfg, cc)
    ffns = []
    for i, layer in enumerate(model.layers):
        spec, src = cfg.ffn_spec(i), layer.mlp
        if spec is not None:
            weights = {k: np.asarray(getattr(src, k)[...], np.float32)
                       for k in ("expert_gate", "expert_up", "expert_down")}
            carved = random_moe_layer(weights, cc.plan, cc.router_neurons, cc.seed + i)
            src = build_hier_ffn(src, hier_spec(spec, cc), carved, model.dtype)
        ffns.append(src)
    cfg_hier = cfg.with_moe_layers([hier_spec(cfg.ffn_spec(i), cc) for i in range(cfg.num_layers)])
    return assemble(model, cfg_hier, ffns)


def manifest_fields(cfg: ModelConfig, cc: ConvertConfig, records: list, min_tokens: int) -> dict:
    """What the manifest of a hierarchical conversion records about both levels."""
    spec = next(s for s in cfg.moe_layers if s is not None)
    plan = cc.plan
    return {
        "method": "cmoe_hierarchical",
        "plan": {"top_level": {"experts": spec.num_experts, "active": spec.top_k,
                               "expert_width": spec.expert_width, "router": spec.router,
                               "host_shared_width": spec.shared_width},
                 "sub_level": {"shared": plan.shared, "active": plan.active, "experts": plan.total,
                               "expert_width": spec.expert_width // plan.total}},
        "min_expert_tokens": min_tokens,
        "layers": [r.to_json() for r in records],
    }

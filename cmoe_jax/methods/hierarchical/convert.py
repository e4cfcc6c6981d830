"""Hierarchical CMoE conversion of an in-memory MoE model: every expert of every MoE layer
carved into shared and routed sub-experts (`cmoe_jax.methods.hierarchical.carve`), layer by layer on
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

from cmoe_jax.methods.cmoe import LayerCarving
from cmoe_jax.methods.hierarchical.carve import (HOST_NAMES, TOP_ROUTER_NAMES, ExpertCarving,
                                           carve_moe_layer, random_moe_layer)
from cmoe_jax.methods.cmoe import ConversionError, ConvertConfig
from cmoe_jax.models import Decoder, FFNSpec, ModelConfig
from cmoe_jax.models.ffn import filled_ffn
from cmoe_jax.moe.routers import get_router
from cmoe_jax.calibration_pass.layer_pass import (LayerInput, LayerStep, calibration_mesh, converted_ffns,
                                                  start_pass)

def is_moe(cfg: ModelConfig) -> bool:
    return any(s is not None for s in cfg.moe_layers)


# Sub-routers score each sub-expert with 8 neurons unless told otherwise: the hierarchical
# figures were measured there (the dense conversion's default, 16, was chosen on dense models).
SUB_ROUTER_NEURONS = 8


def with_sub_router(cc: ConvertConfig) -> ConvertConfig:
    """`cc` with its router neuron count made explicit for hierarchical carving."""
    if cc.router_neurons is not None:
        return cc
    return dataclasses.replace(cc, router_neurons=SUB_ROUTER_NEURONS)


def validate_moe(cfg: ModelConfig, cc: ConvertConfig, min_tokens: int = 32) -> None:
    """Fail before any work on a source or sub-plan that cannot be carved hierarchically."""
    cc = with_sub_router(cc)
    if min_tokens < 1:
        raise ConversionError(f"--min-expert-tokens {min_tokens} must be at least 1")
    if cc.routing != "topk":
        raise ConversionError(f"--routing {cc.routing} is a dense FFN's conversion: an MoE source "
                              "is carved hierarchically, each sub-router choosing its top-k")
    if cc.skip_compensation:
        raise ConversionError("--skip-compensation is fitted with a dense FFN's down projections: an "
                              "MoE source is carved hierarchically, its sub-experts keeping their rows")
    specs = [s for s in cfg.moe_layers if s is not None]
    if not specs:
        raise ConversionError("the model has no MoE layer: hierarchical CMoE needs an MoE source")
    for spec in specs:
        if spec.sub_experts:
            raise ConversionError("the model is already hierarchical: carve its source MoE instead")
        if spec.skip_compensation:
            raise ConversionError("the model's layers predict their skipped experts "
                                  "(skip_compensation), which a hierarchical layer cannot: carve a "
                                  "conversion without --skip-compensation")
        if spec.threshold_routing:
            raise ConversionError("the model's layers route by a threshold (threshold_routing), "
                                  "which a hierarchical layer cannot: carve a conversion made "
                                  "with --routing topk")
        if not get_router(spec.router).learned_gates:
            raise ConversionError(f"top-level router {spec.router!r} has constant gates: hierarchical "
                                  f"CMoE keeps a top level that weighs its experts (linear, cmoe)")
        try:
            cc.plan.validate(spec.expert_width, cc.k_act)
        except ValueError as e:
            raise ConversionError(f"{e} (the per-expert plan S'A'E' splits each expert of width "
                                  f"d_e={spec.expert_width})") from e
        m = cc.plan.expert_width(spec.expert_width)
        if not 1 <= cc.router_neurons <= m:
            raise ConversionError(f"--router-neurons {cc.router_neurons} must be between 1 and the "
                                  f"sub-expert width {m}")


def hier_spec(spec: FFNSpec | None, cc: ConvertConfig) -> FFNSpec | None:
    if spec is None:
        return None
    cc = with_sub_router(cc)
    plan = cc.plan
    return dataclasses.replace(spec, expert_width=plan.expert_width(spec.expert_width),
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


def build_hier_ffn(cfg: ModelConfig, src, spec: FFNSpec, carved: dict, dtype) -> nnx.Module:
    """A `HierMoEFFN` holding the carved sub-experts and the source's top-level router and
    host shared MLP, unchanged. Consumes `carved` (`filled_ffn` drops each array once placed)."""
    values = carved
    for name in (*TOP_ROUTER_NAMES, *HOST_NAMES):
        if hasattr(src, name):
            values[TOP_ROUTER_NAMES.get(name, name)] = np.asarray(getattr(src, name)[...], np.float32)
    return filled_ffn(cfg, spec, values, dtype)


def _expert_weights(src) -> dict:
    return {k: np.asarray(getattr(src, k)[...], np.float32)
            for k in ("expert_gate", "expert_up", "expert_down")}


class ExpertCarver(LayerStep):
    """The hierarchical step of the layer pass: carve every expert of MoE layer i on the
    tokens its router sends it (dense layers pass through); resumed layers reuse their
    carvings. `records` grows by one `HierLayerRecord` per layer."""

    def __init__(self, cfg: ModelConfig, cc: ConvertConfig, min_tokens: int, dtype, done=(),
                 on_layer: Callable[[int, HierLayerRecord], None] | None = None):
        super().__init__(done, on_layer)
        self.cfg, self.cc, self.min_tokens, self.dtype = cfg, cc, min_tokens, dtype

    def __call__(self, inputs: LayerInput) -> nnx.Module:
        i, src, x = inputs.index, inputs.layer.mlp, inputs.ffn_input
        seconds, experts, ffn = {"attention": inputs.seconds}, [], src
        spec = self.cfg.ffn_spec(i)
        if spec is not None:
            t1 = time.perf_counter()
            xf = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
            top_ids = np.asarray(_top_ids(*nnx.split(src), jnp.asarray(xf)))
            carved, experts = carve_moe_layer(
                xf, top_ids, _expert_weights(src), self.cc, min_tokens=self.min_tokens,
                done=self.done[i].experts if i < len(self.done) else None,
                activation=self.cfg.activation)
            seconds["carve"] = time.perf_counter() - t1
            ffn = build_hier_ffn(self.cfg, src, hier_spec(spec, self.cc), carved, self.dtype)
        self.records.append(HierLayerRecord(experts, np.zeros(0), seconds))
        self._t_forward = time.perf_counter()
        return ffn


def convert_moe_model(model: Decoder, calib: np.ndarray, cc: ConvertConfig, *,
                      min_tokens: int = 32, devices=None,
                      progress: bool = True, done: list | None = None,
                      on_layer: Callable[[int, HierLayerRecord], None] | None = None):
    """Carve every expert of the MoE `model` with the per-expert plan `cc.plan`:
    -> (hierarchical model, [HierLayerRecord]).

    `done`: records of finished layers
    (resume): their carvings are reused, so the result equals an uninterrupted run."""
    cfg, cc = model.config, with_sub_router(cc)
    validate_moe(cfg, cc, min_tokens)
    calib = np.asarray(calib, np.int32)
    mesh = calibration_mesh(calib.shape[0], devices)
    h, rope = start_pass(model, calib, mesh)
    step = ExpertCarver(cfg, cc, min_tokens, model.dtype, done or (), on_layer)
    ffns = converted_ffns(model.layers, h, rope, mesh, step,
                          desc=f"carving experts ({cc.plan.name} each)", progress=progress)
    cfg_hier = cfg.with_moe_layers([hier_spec(cfg.ffn_spec(i), cc) for i in range(cfg.num_layers)])
    return model.with_ffns(cfg_hier, ffns), step.records


def random_hierarchical(model: Decoder, cc: ConvertConfig) -> Decoder:
    """The labelled baseline at the same active width: every expert split into random
    sub-experts with a random sub-router (`random_moe_layer`); no calibration data."""
    cfg, cc = model.config, with_sub_router(cc)
    validate_moe(cfg, cc)
    ffns = []
    for i, layer in enumerate(model.layers):
        spec, src = cfg.ffn_spec(i), layer.mlp
        if spec is not None:
            carved = random_moe_layer(_expert_weights(src), cc.plan, cc.router_neurons, cc.seed + i)
            src = build_hier_ffn(cfg, src, hier_spec(spec, cc), carved, model.dtype)
        ffns.append(src)
    cfg_hier = cfg.with_moe_layers([hier_spec(cfg.ffn_spec(i), cc) for i in range(cfg.num_layers)])
    return model.with_ffns(cfg_hier, ffns)


def manifest_fields(cfg: ModelConfig, cc: ConvertConfig, records: list, min_tokens: int) -> dict:
    """What the manifest of a hierarchical conversion records about both levels."""
    spec = next(s for s in cfg.moe_layers if s is not None)
    cc = with_sub_router(cc)
    plan = cc.plan
    return {
        "method": "cmoe_hierarchical",
        "plan": {"top_level": {"experts": spec.num_experts, "active": spec.top_k,
                               "expert_width": spec.expert_width, "router": spec.router,
                               "host_shared_width": spec.shared_width},
                 "sub_level": {"shared": plan.shared, "active": plan.active, "experts": plan.total,
                               "expert_width": plan.expert_width(spec.expert_width)}},
        "min_expert_tokens": min_tokens,
        "down_fit": {"ridge": 0.0, "tokens": 0},  # the sub-experts keep their source rows
        "layers": [r.to_json() for r in records],
    }

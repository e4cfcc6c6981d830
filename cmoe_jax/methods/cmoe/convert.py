"""CMoE conversion of an in-memory dense model: profile, carve and route, layer by layer.

Each layer is profiled on the calibration activations that the already-converted layers
before it produce (as in the papers), so only one layer's activations live at a time.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np
from flax import nnx

from cmoe_jax.methods.cmoe.config import ROUTER_REPS, ROUTINGS, SHARED_BY, ConversionError, ConvertConfig
from cmoe_jax.methods.cmoe.carve import LayerCarving, NeuronScores, carve_layer, slice_ffn
from cmoe_jax.methods.cmoe.plan import MoEPlan
from cmoe_jax.calibration_pass.markers import profile_layer
from cmoe_jax.methods.cmoe.layer_fit import fit_layer
from cmoe_jax import distributed
from cmoe_jax.models import Decoder, FFNSpec, ModelConfig
from cmoe_jax.models.ffn import filled_ffn
from cmoe_jax.calibration_pass.layer_pass import (LayerInput, LayerStep, calibration_mesh, converted_ffns,
                                                  start_pass, window_chunks)


@dataclasses.dataclass
class LayerRecord:
    """What one converted layer keeps: its partition plus profiling statistics."""

    carving: LayerCarving
    mu: np.ndarray
    load: np.ndarray
    seconds: dict
    router_scales: np.ndarray | None = None  # fitted per-expert score scales (None: not fitted)
    gate_scales: np.ndarray | None = None  # fitted gate scales u (None: u = 0)
    error: float | None = None  # relative change of the stream after the layer (`stream_error`)

    def to_json(self) -> dict:
        c = self.carving
        return {"shared": np.asarray(c.shared_idx).tolist(),
                "experts": np.asarray(c.expert_idx).tolist(),
                "representatives": np.asarray(c.representative_idx).tolist(),
                "kmeans_iterations": int(c.iterations),
                "mu": np.asarray(self.mu, np.float32).tolist(),
                "load": np.asarray(self.load).tolist(), "seconds": self.seconds,
                "router_scales": (None if self.router_scales is None
                                  else np.asarray(self.router_scales, np.float64).tolist()),
                "gate_scales": (None if self.gate_scales is None
                                else np.asarray(self.gate_scales, np.float64).tolist()),
                "error": self.error}

    @classmethod
    def from_json(cls, d: dict) -> "LayerRecord":
        experts, reps = (_rows(d[k]) for k in ("experts", "representatives"))
        carving = LayerCarving(shared_idx=np.asarray(d["shared"], np.int64), expert_idx=experts,
                               representative_idx=reps,
                               iterations=d["kmeans_iterations"])
        return cls(carving, np.asarray(d["mu"], np.float32), np.asarray(d["load"]), d["seconds"])


def _rows(nested) -> np.ndarray:
    """A JSON list of equal-length index lists as [rows, width] (a kept dense layer: [0, 0])."""
    return np.asarray(nested, np.int64).reshape(len(nested), -1) if nested else np.zeros((0, 0), np.int64)


def validate(cfg: ModelConfig, calib: np.ndarray, cc: ConvertConfig) -> None:
    """Fail before any work on inputs that cannot be converted."""
    if cfg.moe_layers and any(s is not None for s in cfg.moe_layers):
        raise ConversionError("the model already has MoE FFN layers: CMoE conversion needs a "
                              "dense model")
    check_plans(cfg, cc)
    check_router(cfg, cc)
    if calib.ndim != 2 or calib.shape[0] < 1:
        raise ConversionError(f"calibration data must be [samples, seqlen] token ids, got {calib.shape}")


def carved_plans(cfg: ModelConfig, cc: ConvertConfig) -> list[MoEPlan]:
    """The distinct shapes the layers are carved to (kept-dense layers have none)."""
    if cc.layer_plans is None:
        return [cc.plan]
    return sorted({p for p in cc.layer_shapes(cfg.num_layers) if p is not None}, key=lambda p: p.name)


def check_plans(cfg: ModelConfig, cc: ConvertConfig) -> None:
    try:
        for plan in carved_plans(cfg, cc):
            plan.validate(cfg.intermediate_size, cc.k_act)
    except ValueError as e:
        raise ConversionError(str(e)) from e


def check_router(cfg: ModelConfig, cc: ConvertConfig) -> None:
    m = min([p.expert_width(cfg.intermediate_size) for p in carved_plans(cfg, cc)], default=1)
    if cc.router_neurons is not None and not 1 <= cc.router_neurons <= m:
        raise ConversionError(f"--router-neurons {cc.router_neurons} must be between 1 and the "
                              f"expert width {m}")
    if cc.shared_by not in SHARED_BY:
        raise ConversionError(f"--shared-by {cc.shared_by!r} must be one of {', '.join(SHARED_BY)}")
    if cc.router_reps not in ROUTER_REPS:
        raise ConversionError(f"--router-reps {cc.router_reps!r} must be one of {', '.join(ROUTER_REPS)}")
    if cc.routing not in ROUTINGS:
        raise ConversionError(f"--routing {cc.routing!r} must be one of {', '.join(ROUTINGS)}")
    if cc.router_fit_tokens < 1:
        raise ConversionError(f"--router-fit-tokens {cc.router_fit_tokens} must be at least 1")
    if not 0 <= cc.down_fit < float("inf"):
        raise ConversionError(f"--down-fit {cc.down_fit} must be a finite ridge of at least 0")
    if cc.skip_compensation and not cc.down_fit:
        raise ConversionError("--skip-compensation is fitted with the down projections: give a "
                              "--down-fit ridge above 0")
    if cc.down_fit_tokens is not None and cc.down_fit_tokens < 1:
        raise ConversionError(f"--down-fit-tokens {cc.down_fit_tokens} must be at least 1")


def conversion_mesh(cc: ConvertConfig, num_windows: int, devices=None, expert_parallel: int = 1,
                    plans=None):
    """The calibration mesh; with `expert_parallel > 1` each converted layer's routed experts
    are split over an "expert" axis of that many devices for its forward pass. `plans`: the
    layers' distinct shapes (default: the uniform one)."""
    for plan in plans or ([cc.plan] if cc.plan is not None else []):
        if expert_parallel > 1 and plan.routed % expert_parallel:
            raise ConversionError(f"--expert-parallel {expert_parallel} does not divide the "
                                  f"{plan.routed} routed experts of {plan.name}")
    return calibration_mesh(num_windows, devices, expert=expert_parallel)


def moe_spec(cfg: ModelConfig, cc: ConvertConfig, plan: MoEPlan | None) -> FFNSpec | None:
    """The FFN spec of a layer carved to `plan` (None: the layer stays dense). Routed by a
    threshold, a token may run every routed expert (`top_k` is the cap; the threshold,
    fitted per layer, holds the mean to the plan's y)."""
    if plan is None:
        return None
    m = plan.expert_width(cfg.intermediate_size)
    threshold = cc.routing == "threshold"
    return FFNSpec(num_experts=plan.routed, top_k=plan.routed if threshold else plan.active, expert_width=m,
                   shared_width=plan.shared_width(cfg.intermediate_size), router="cmoe",
                   router_neurons=cc.neurons_for(m), skip_compensation=cc.skip_compensation,
                   threshold_routing=threshold)


def carve_one_layer(layer, x, cc: ConvertConfig, plan: MoEPlan) -> tuple[LayerCarving, np.ndarray, dict]:
    """Profile the FFN input x [N, T, d] of one dense layer and carve its neurons to `plan`.

    In a multi-process run each process profiles its own windows; markers and per-window
    energy sums are gathered in window order and reduced as sums, so the statistics are the
    single-process ones; the partition is carved once, on process 0, and broadcast."""
    t0 = time.perf_counter()
    markers, mu, energy = layer_profile(layer, x, cc)
    t1 = time.perf_counter()
    carving = carve_on_main(markers, mu, energy, cc, plan)
    return carving, mu, {"profile": t1 - t0, "cluster": time.perf_counter() - t1}


def carve_on_main(markers, mu, energy, cc: ConvertConfig, plan: MoEPlan) -> LayerCarving:
    """`carve_profiled` on process 0, broadcast to the others (a failure raised on all)."""
    carving = None
    if distributed.is_main():
        try:
            carving = carve_profiled(markers, mu, energy, cc, plan)
        except Exception as e:  # every process fails, none waits for the broadcast
            carving = e
    carving = distributed.broadcast_from_main(carving)
    if isinstance(carving, Exception):
        raise carving
    return carving


def layer_profile(layer, x, cc: ConvertConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ATopK markers [T, d_h], activation rates mu [d_h], output energies [d_h]) of one
    dense layer's FFN on its input x [N, T, d], gathered over processes."""
    mlp = layer.mlp
    parts = []
    for chunk in window_chunks(x):  # the FFN's [tokens, d_h] intermediates for a few windows at a time
        markers, _, energy = profile_layer(chunk.reshape(-1, x.shape[-1]), mlp.gate[...], mlp.up[...],
                                           mlp.down[...], k_act=cc.k_act, normalize=cc.normalize,
                                           windows=chunk.shape[0], activation=mlp.activation)
        parts.append((np.asarray(markers), np.asarray(energy)))
    markers = distributed.gather_rows(np.concatenate([m for m, _ in parts]))
    energy = distributed.gather_rows(np.concatenate([e for _, e in parts])).astype(np.float64).sum(0)
    tokens = markers.shape[0]
    mu = markers.sum(axis=0, dtype=np.int64).astype(np.float32) / np.float32(tokens)
    return markers, mu, (energy / tokens).astype(np.float32)


def carve_profiled(markers, mu, energy, cc: ConvertConfig, plan: MoEPlan) -> LayerCarving:
    """`carve_layer` to `plan` with the options of `cc` on one FFN's profile (markers [T, d_h],
    rates mu and output energies [d_h]): the conversion's carve, also `carve_ffn`'s."""
    return carve_layer(markers, mu, plan, k_act=cc.k_act, kmeans_iters=cc.kmeans_iters,
                       router_neurons=cc.neurons_for(plan.expert_width(markers.shape[1])),
                       scores=NeuronScores(
                           shared=shared_score(mu, energy, cc), ties=energy,
                           representatives=energy if cc.router_reps == "energy" else None))


def shared_score(mu, energy, cc: ConvertConfig):
    """What the shared set is the top of: None (rate mu, the paper's rule), the output energy
    E[h^2] ||W_down row||^2, or ("rate-energy") their product: the energy a neuron carries,
    weighted by how often it is among a token's strongest, so neither a neuron that is often
    marked but contributes little nor a rare large one takes an always-on slot."""
    if cc.shared_by == "energy":
        return energy
    if cc.shared_by == "rate-energy":
        return np.asarray(mu, np.float64) * np.asarray(energy, np.float64)
    return None


def kept_dense(d_h: int) -> LayerCarving:
    """The partition of a layer that stays dense: every neuron always on, no routed expert."""
    return LayerCarving(shared_idx=np.arange(d_h), expert_idx=np.zeros((0, 0), np.int64),
                        representative_idx=np.zeros((0, 0), np.int64), iterations=0)


def slices_for(layer, carving: LayerCarving) -> dict:
    mlp = layer.mlp
    return slice_ffn(np.asarray(mlp.gate[...], np.float32), np.asarray(mlp.up[...], np.float32),
                     np.asarray(mlp.down[...], np.float32), carving)


class LayerConverter(LayerStep):
    """The CMoE step of the layer pass: carve dense layer i on its FFN input (or reuse the
    partition of a resumed layer), build its MoE FFN and fit the router's score scales;
    `records` grows by one `LayerRecord` per layer."""

    def __init__(self, cfg: ModelConfig, cc: ConvertConfig, mesh, done=(),
                 on_layer: Callable[[int, LayerRecord], None] | None = None):
        super().__init__(done, on_layer)
        self.cfg, self.cc, self.mesh = cfg, cc, mesh

    def __call__(self, inputs: LayerInput) -> nnx.Module:
        i, layer, x = inputs.index, inputs.layer, inputs.ffn_input
        plan = self.cc.plan_at(i)
        if i < len(self.done):
            record = self.done[i]
        elif plan is None:  # kept dense: nothing to profile or carve
            record = LayerRecord(kept_dense(self.cfg.intermediate_size), np.zeros(0, np.float32),
                                 np.zeros(0), {"attention": inputs.seconds})
        else:
            carving, mu, secs = carve_one_layer(layer, x, self.cc, plan)
            record = LayerRecord(carving, mu, np.zeros(0), dict(secs, attention=inputs.seconds))
        self._t_forward = time.perf_counter()
        if plan is None:
            record.error = 0.0
            self.records.append(record)
            return layer.mlp
        ffn = filled_ffn(self.cfg, moe_spec(self.cfg, self.cc, plan), slices_for(layer, record.carving),
                         layer.mlp.gate[...].dtype)
        fits = fit_layer(ffn, x, self.cc, self.mesh, plan.active)
        record.router_scales, record.gate_scales = fits.router_scales, fits.gate_scales
        dense = (inputs.stream_after(layer.mlp, self.mesh) if fits.dense_output is None  # the fit's target, else a dense pass
                 else inputs.stream_with_output(fits.dense_output, self.mesh))
        record.error = stream_error(inputs.run(ffn, self.mesh), dense)
        self.records.append(record)
        return ffn


def stream_error(stream, dense_stream) -> float:
    """||stream after the layer with a carved FFN - with the dense FFN||^2 / ||the dense
    one||^2 over every calibration token (all processes; the streams from
    `LayerInput.stream_after`): how much of what the next layer reads the carving changed (a
    norm on the FFN's output, as in Gemma, included)."""
    change = stream - dense_stream
    return _total(change ** 2) / _total(dense_stream ** 2)


def _total(squares) -> float:
    return float(distributed.sum_across_processes(np.asarray(squares.sum(), np.float64)))


def convert_model(model: Decoder, calib: np.ndarray, cc: ConvertConfig, *, devices=None,
                  progress: bool = True, done: list[LayerRecord] | None = None,
                  on_layer: Callable[[int, LayerRecord], None] | None = None,
                  expert_parallel: int = 1):
    """Convert `model` (dense) with calibration windows `calib` [N, T] -> (moe_model, records).

    `done` holds records of layers already converted (resume): they are rebuilt from their
    partitions and only re-run forward, so the result equals an uninterrupted run.
    `expert_parallel`: devices the converted layers' routed experts are split over when
    they run forward (the batch is split over the remaining ones; 1: every device holds all).
    """
    cfg = model.config
    calib = np.asarray(calib, np.int32)
    validate(cfg, calib, cc)
    mesh = conversion_mesh(cc, calib.shape[0], devices, expert_parallel, carved_plans(cfg, cc))
    h, rope = start_pass(model, calib, mesh)
    step = LayerConverter(cfg, cc, mesh, done or (), on_layer)
    ffns = converted_ffns(model.layers, h, rope, mesh, step, desc=f"converting to {cc.label}",
                          progress=progress)
    cfg_moe = cfg.with_moe_layers([moe_spec(cfg, cc, p) for p in cc.layer_shapes(cfg.num_layers)])
    return model.with_ffns(cfg_moe, ffns), step.records

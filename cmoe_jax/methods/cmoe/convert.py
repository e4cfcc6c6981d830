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

from cmoe_jax.methods.cmoe.carve import LayerCarving, NeuronScores, carve_layer, slice_ffn
from cmoe_jax.methods.cmoe.plan import MoEPlan
from cmoe_jax.profiling.markers import profile_layer
from cmoe_jax.methods.cmoe.router_fit import fit_router
from cmoe_jax import distributed
from cmoe_jax.errors import CmoeError
from cmoe_jax.models import Decoder, FFNSpec, ModelConfig
from cmoe_jax.models.ffn import filled_ffn
from cmoe_jax.profiling.layer_pass import (LayerInput, LayerStep, calibration_mesh, converted_ffns,
                                           start_pass)


class ConversionError(CmoeError):
    """Bad conversion input (plan, calibration data, activations)."""


SHARED_BY = ("energy", "rate", "rate-energy")
ROUTER_REPS = ("centroid", "energy")

@dataclasses.dataclass(frozen=True)
class ConvertConfig:
    """What to convert to and how (the CLI flags, minus I/O)."""

    plan: MoEPlan
    k_act: int = 10
    normalize: bool = True
    kmeans_iters: int | None = None  # None: iterate to convergence; 1: the authors' code
    seed: int = 0
    # Router: r representative neurons per expert (1: the paper's), and per-expert score
    # scales fitted on `router_fit_tokens` calibration tokens (False: the paper's raw |h|).
    router_neurons: int = 8
    router_scale: bool = True
    router_fit_tokens: int = 2048
    # Shared experts: neurons of highest activation rate mu times output energy E[h^2] ||W_down
    # row||^2 ("rate-energy", the default: best of the three on SmolLM2 and Gemma 3 at 25% and
    # 75% active), of highest mu ("rate", the paper's rule) or of highest energy ("energy").
    shared_by: str = "rate-energy"
    # Router neurons of each expert: its members closest to the cluster centroid ("centroid",
    # the paper's rule) or of highest output energy ("energy", the default: the neurons whose
    # output matters most; best measured on every plan of the README's table).
    router_reps: str = "energy"
    # Gate scales u of the gates 1 + s'u: fitted by least squares to make up for the
    # unselected experts on the calibration tokens, or 0 (False: the paper's unweighted sum).
    gate_fit: bool = True

    # The CMoE paper's analytical router: one representative neuron per expert, the member
    # closest to the centroid, raw |h| scores, gates 1 (`--paper-router`).
    PAPER_ROUTER = {"router_neurons": 1, "router_reps": "centroid", "router_scale": False,
                    "gate_fit": False}

    def to_dict(self) -> dict:
        return {"config": self.plan.name, "k_act": self.k_act, "normalize": self.normalize,
                "kmeans_iters": self.kmeans_iters, "seed": self.seed,
                "router_neurons": self.router_neurons, "router_scale": self.router_scale,
                "router_fit_tokens": self.router_fit_tokens, "shared_by": self.shared_by,
                "router_reps": self.router_reps, "gate_fit": self.gate_fit}


@dataclasses.dataclass
class LayerRecord:
    """What one converted layer keeps: its partition plus profiling statistics."""

    carving: LayerCarving
    mu: np.ndarray
    load: np.ndarray
    seconds: dict
    router_scales: np.ndarray | None = None  # fitted per-expert score scales (None: not fitted)
    gate_scales: np.ndarray | None = None  # fitted gate scales u (None: u = 0)

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
                                else np.asarray(self.gate_scales, np.float64).tolist())}

    @classmethod
    def from_json(cls, d: dict) -> "LayerRecord":
        experts = np.asarray(d["experts"], np.int64)
        carving = LayerCarving(shared_idx=np.asarray(d["shared"], np.int64), expert_idx=experts,
                               representative_idx=np.asarray(d["representatives"], np.int64)
                               .reshape(len(experts), -1),
                               iterations=d["kmeans_iterations"])
        return cls(carving, np.asarray(d["mu"], np.float32), np.asarray(d["load"]), d["seconds"])


def validate(cfg: ModelConfig, calib: np.ndarray, cc: ConvertConfig) -> None:
    """Fail before any work on inputs that cannot be converted."""
    if cfg.moe_layers and any(s is not None for s in cfg.moe_layers):
        raise ConversionError("the model already has MoE FFN layers: CMoE conversion needs a "
                              "dense model")
    try:
        cc.plan.validate(cfg.intermediate_size, cc.k_act)
    except ValueError as e:
        raise ConversionError(str(e)) from e
    check_router(cfg, cc)
    if calib.ndim != 2 or calib.shape[0] < 1:
        raise ConversionError(f"calibration data must be [samples, seqlen] token ids, got {calib.shape}")


def check_router(cfg: ModelConfig, cc: ConvertConfig) -> None:
    m = cc.plan.expert_width(cfg.intermediate_size)
    if not 1 <= cc.router_neurons <= m:
        raise ConversionError(f"--router-neurons {cc.router_neurons} must be between 1 and the "
                              f"expert width {m}")
    if cc.shared_by not in SHARED_BY:
        raise ConversionError(f"--shared-by {cc.shared_by!r} must be one of {', '.join(SHARED_BY)}")
    if cc.router_reps not in ROUTER_REPS:
        raise ConversionError(f"--router-reps {cc.router_reps!r} must be one of {', '.join(ROUTER_REPS)}")
    if cc.router_fit_tokens < 1:
        raise ConversionError(f"--router-fit-tokens {cc.router_fit_tokens} must be at least 1")


def conversion_mesh(cc: ConvertConfig, num_windows: int, devices=None, expert_parallel: int = 1):
    """The calibration mesh; with `expert_parallel > 1` each converted layer's routed experts
    are split over an "expert" axis of that many devices for its forward pass."""
    routed = cc.plan.total - cc.plan.shared
    if expert_parallel > 1 and routed % expert_parallel:
        raise ConversionError(f"--expert-parallel {expert_parallel} does not divide the {routed} "
                              f"routed experts of {cc.plan.name}")
    return calibration_mesh(num_windows, devices, expert=expert_parallel)


def moe_spec(cfg: ModelConfig, cc: ConvertConfig) -> FFNSpec:
    plan = cc.plan
    m = plan.expert_width(cfg.intermediate_size)
    return FFNSpec(num_experts=plan.routed, top_k=plan.active, expert_width=m,
                   shared_width=plan.shared_width(cfg.intermediate_size), router="cmoe",
                   router_neurons=cc.router_neurons)


def carve_one_layer(layer, x, cc: ConvertConfig) -> tuple[LayerCarving, np.ndarray, dict]:
    """Profile the FFN input x [N, T, d] of one dense layer and carve its neurons.

    In a multi-process run each process profiles its own windows; markers and per-window
    energy sums are gathered in window order and reduced as sums, so the statistics are the
    single-process ones; the partition is carved once, on process 0, and broadcast."""
    t0 = time.perf_counter()
    mlp = layer.mlp
    markers, _, energy = profile_layer(x.reshape(-1, x.shape[-1]), mlp.gate[...], mlp.up[...],
                                       mlp.down[...], k_act=cc.k_act, normalize=cc.normalize,
                                       windows=x.shape[0], activation=mlp.activation)
    markers = distributed.gather_rows(np.asarray(markers))
    energy = distributed.gather_rows(np.asarray(energy)).astype(np.float64).sum(0)
    tokens = markers.shape[0]
    mu = markers.sum(axis=0, dtype=np.int64).astype(np.float32) / np.float32(tokens)
    energy = (energy / tokens).astype(np.float32)
    t1 = time.perf_counter()
    carving = None
    if distributed.is_main():
        try:
            carving = carve_profiled(markers, mu, energy, cc)
        except Exception as e:  # every process fails, none waits for the broadcast
            carving = e
    carving = distributed.broadcast_from_main(carving)
    if isinstance(carving, Exception):
        raise carving
    t2 = time.perf_counter()
    return carving, mu, {"profile": t1 - t0, "cluster": t2 - t1}


def carve_profiled(markers, mu, energy, cc: ConvertConfig) -> LayerCarving:
    """`carve_layer` with the options of `cc` on one FFN's profile (markers [T, d_h], rates
    mu and output energies [d_h]): the conversion's carve, also `carve_ffn`'s."""
    return carve_layer(markers, mu, cc.plan, k_act=cc.k_act, kmeans_iters=cc.kmeans_iters,
                       router_neurons=cc.router_neurons, scores=NeuronScores(
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
        if i < len(self.done):
            record = self.done[i]
        else:
            carving, mu, secs = carve_one_layer(layer, x, self.cc)
            record = LayerRecord(carving, mu, np.zeros(0), dict(secs, attention=inputs.seconds))
        self._t_forward = time.perf_counter()
        ffn = filled_ffn(self.cfg, moe_spec(self.cfg, self.cc), slices_for(layer, record.carving),
                         layer.mlp.gate[...].dtype)
        record.router_scales, record.gate_scales = fit_router(ffn, x, self.cc, self.mesh)
        self.records.append(record)
        return ffn


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
    mesh = conversion_mesh(cc, calib.shape[0], devices, expert_parallel)
    h, rope = start_pass(model, calib, mesh)
    step = LayerConverter(cfg, cc, mesh, done or (), on_layer)
    ffns = converted_ffns(model.layers, h, rope, mesh, step, desc=f"converting to {cc.plan.name}",
                          progress=progress)
    cfg_moe = cfg.with_moe_layers([moe_spec(cfg, cc)] * cfg.num_layers)
    return model.with_ffns(cfg_moe, ffns), step.records

"""ExpertWeaver conversion of an in-memory dense model, layer by layer (the algorithm is in `weave.py`).

Like the CMoE pipeline, each layer is profiled on the FFN inputs that the already-converted
layers before it produce, so only one layer's activations live at a time. Each layer gets its
own `FFNSpec`: N_se,l shared experts fused into one shared MLP of width N_se,l d_expert,
N_e - N_se,l routed experts stacked for the grouped matmuls, and top_k = k - N_se,l, so the
variable shared size costs no Python branching at run time.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from cmoe_jax.methods.expertweaver.weave import (ASSIGNMENTS, WovenLayer, active_experts, gate_profiles,
                                           router_centroids, weave_layer)
from cmoe_jax.methods.cmoe import ConversionError
from cmoe_jax.models import Decoder, FFNSpec, ModelConfig
from cmoe_jax.models.ffn import filled_ffn
from cmoe_jax.calibration_pass.layer_pass import (LayerInput, LayerStep, calibration_mesh, converted_ffns,
                                                  start_pass)
from cmoe_jax.calibration_pass.markers import output_energy
from cmoe_jax.methods.streamed_pass import Streamed, streamed_pass


SHARED_BY = ("energy", "profile")


@dataclasses.dataclass(frozen=True)
class WeaveConfig:
    """ExpertWeaver settings. `n_shared` None: the layer-adaptive rule, training-free router
    ("topsum"); an int: that many shared experts in every layer (downcycling, "linear")."""

    experts: int = 64
    sparsity: float = 0.25
    alpha_min: float = 0.2
    alpha_max: float = 0.7
    tau: float = 0.6
    assignment: str = "greedy"
    seed: int = 0
    n_shared: int | None = None
    router: str = "topsum"
    random_split: bool = False  # shared/routed neurons drawn at random (downcycling ablation)
    # shared neurons: highest mean gate profile ("profile", the paper) or highest output
    # energy E[h^2] ||W_down row||^2 ("energy", CMoE's `--shared-by energy`)
    shared_by: str = "profile"

    @property
    def active(self) -> int:
        return active_experts(self.sparsity, self.experts)

    @property
    def name(self) -> str:
        return f"EW-E{self.experts}-k{self.active}"

    def to_dict(self) -> dict:
        return {"method": "expertweaver", **dataclasses.asdict(self)}


def validate(cfg: ModelConfig, cc: WeaveConfig) -> None:
    """Fail before any work on settings that cannot be converted."""
    if cfg.moe_layers and any(s is not None for s in cfg.moe_layers):
        raise ConversionError("the model already has MoE FFN layers: ExpertWeaver needs a dense model")
    if cc.experts < 2 or cfg.intermediate_size % cc.experts:
        raise ConversionError(f"--experts {cc.experts} must be at least 2 and divide the FFN width "
                              f"{cfg.intermediate_size}")
    if not 0.0 <= cc.sparsity < 1.0:
        raise ConversionError(f"--sparsity {cc.sparsity} must be in [0, 1)")
    if not 2 <= cc.active <= cc.experts:
        raise ConversionError(f"--sparsity {cc.sparsity} leaves k={cc.active} of {cc.experts} experts "
                              "active: k must be at least 2 (one shared, one routed)")
    if not 0.0 <= cc.alpha_min <= cc.alpha_max <= 1.0:
        raise ConversionError(f"need 0 <= --alpha-min ({cc.alpha_min}) <= --alpha-max ({cc.alpha_max}) <= 1")
    if cc.tau < 0:
        raise ConversionError(f"--tau {cc.tau} must be non-negative")
    if cc.assignment not in ASSIGNMENTS:
        raise ConversionError(f"--assignment {cc.assignment!r} must be one of {', '.join(ASSIGNMENTS)}")
    if cc.shared_by not in SHARED_BY:
        raise ConversionError(f"--shared-by {cc.shared_by!r} must be one of {', '.join(SHARED_BY)}")
    if cc.n_shared is not None and not 0 <= cc.n_shared < cc.active:
        raise ConversionError(f"--shared-experts {cc.n_shared} must be in [0, k={cc.active})")


def layer_spec(cfg: ModelConfig, cc: WeaveConfig, n_shared: int) -> FFNSpec:
    m = cfg.intermediate_size // cc.experts
    return FFNSpec(num_experts=cc.experts - n_shared, top_k=cc.active - n_shared, expert_width=m,
                   shared_width=n_shared * m, router=cc.router)


def woven_slices(w_gate, w_up, w_down, woven: WovenLayer) -> dict:
    """MoEFFN parameters (JAX layout) cut from a dense SwiGLU FFN: a permutation of its neurons."""
    s, e = woven.shared_idx, woven.expert_idx
    n, m = e.shape
    d = w_gate.shape[0]
    flat = e.reshape(-1)
    return {"shared_gate": w_gate[:, s], "shared_up": w_up[:, s], "shared_down": w_down[s, :],
            "expert_gate": w_gate[:, flat].reshape(d, n, m).transpose(1, 0, 2),
            "expert_up": w_up[:, flat].reshape(d, n, m).transpose(1, 0, 2),
            "expert_down": w_down[flat, :].reshape(n, m, d),
            "router_kernel": router_centroids(w_gate, e)}


class LayerWeaver(LayerStep):
    """The ExpertWeaver step of the layer pass: gate profiles of layer i per task, the
    adaptive shared/routed split and clustering (or a resumed layer's record), the woven
    MoE FFN. `records` (JSON dicts) and `specs` grow by one per layer."""

    def __init__(self, cfg: ModelConfig, cc: WeaveConfig, task_ids: np.ndarray, dtype, done=(),
                 on_layer: Callable[[int, dict], None] | None = None):
        super().__init__(done, on_layer)
        self.cfg, self.cc, self.task_ids, self.dtype = cfg, cc, task_ids, dtype
        self.specs: list[FFNSpec] = []

    def __call__(self, inputs: LayerInput) -> nnx.Module:
        i, mlp, cc = inputs.index, inputs.layer.mlp, self.cc
        if i < len(self.done):
            record = self.done[i]
        else:
            t0 = time.perf_counter()
            profiles = np.asarray(gate_profiles(inputs.ffn_input, mlp.gate[...], mlp.activation))
            energy = (np.asarray(output_energy(inputs.ffn_input, mlp.gate[...], mlp.up[...],
                                               mlp.down[...], mlp.activation))
                      if cc.shared_by == "energy" else None)
            t1 = time.perf_counter()
            woven = weave_layer(profiles, self.task_ids, cc, layer=i, max_shared=cc.active - 1,
                                shared_score=energy)
            record = dict(woven.to_json(), seconds={"profile": inputs.seconds + t1 - t0,
                                                    "cluster": time.perf_counter() - t1})
        woven = WovenLayer.from_json(record)
        spec = layer_spec(self.cfg, cc, woven.n_shared)
        weights = [np.asarray(p[...], np.float32) for p in (mlp.gate, mlp.up, mlp.down)]
        self.records.append(record)
        self.specs.append(spec)
        return filled_ffn(self.cfg, spec, woven_slices(*weights, woven), self.dtype)

    def set_load(self, record: dict, load: np.ndarray, seconds: float) -> None:
        record["load"] = load.tolist()  # a JSON record; its seconds are profile and cluster


def _checked_windows(cfg: ModelConfig, cc: WeaveConfig, windows, task_ids) -> np.ndarray:
    validate(cfg, cc)
    windows = np.asarray(windows, np.int32)
    if len(np.unique(task_ids)) < 2 or len(task_ids) != len(windows):
        raise ConversionError("ExpertWeaver needs calibration samples from at least 2 tasks")
    return windows


def weave_model(model: Decoder, windows: np.ndarray, task_ids: np.ndarray, cc: WeaveConfig, *,
                devices=None, progress: bool = True, done: list[dict] | None = None,
                on_layer: Callable[[int, dict], None] | None = None):
    """Convert `model` with calibration windows [N, T] of tasks `task_ids` [N] ->
    (moe_model, per-layer records). `done`: records of layers finished before (resume)."""
    cfg = model.config
    windows = _checked_windows(cfg, cc, windows, task_ids)
    mesh = calibration_mesh(windows.shape[0], devices)
    h, rope = start_pass(model, windows, mesh)
    step = LayerWeaver(cfg, cc, task_ids, model.dtype, done or (), on_layer)
    ffns = converted_ffns(model.layers, h, rope, mesh, step, desc=f"weaving {cc.name}",
                          progress=progress)
    return model.with_ffns(cfg.with_moe_layers(step.specs), ffns), step.records


def weave_streamed(model: Streamed, windows: np.ndarray, task_ids: np.ndarray, cc: WeaveConfig, *,
                   devices=None, progress: bool = True, done: list[dict] | None = None,
                   on_layer: Callable[[int, dict], None] | None = None) -> tuple[ModelConfig, list[dict]]:
    """`weave_model` of the dense model in `model.source`, read, woven and written into
    `model.out` one layer at a time (`streamed_pass`) -> (converted config, records): the
    same layers as in memory (float32, as the job loads them)."""
    cfg = model.config
    windows = _checked_windows(cfg, cc, windows, task_ids)
    mesh = calibration_mesh(windows.shape[0], devices)
    step = LayerWeaver(cfg, cc, task_ids, jnp.float32, done or (), on_layer)

    # at layer i's save the step has woven layers 0..i: the rest are dense in that config
    streamed_pass(model, windows, mesh, step,
                  lambda i: cfg.with_moe_layers(step.specs + [None] * (cfg.num_layers - len(step.specs))),
                  desc=f"weaving {cc.name} (streamed)", progress=progress)
    return cfg.with_moe_layers(step.specs), step.records

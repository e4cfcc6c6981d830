"""CMoE as a job's steps (run by `cmoe_jax.jobs.run_job`): its settings, its checks against the
source, its calibration windows and fingerprint, the layer-by-layer conversion (in memory or
streamed), its manifest and its report."""
from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp
import numpy as np

from cmoe_jax import distributed
from cmoe_jax.data import Calibration
from cmoe_jax.errors import CmoeError
from cmoe_jax.loading import window_bos
from cmoe_jax.methods.cmoe import flags
from cmoe_jax.methods.cmoe.budget import AUTO, Budget, adaptive_config, check_budget
from cmoe_jax.methods.cmoe.config import ConvertConfig
from cmoe_jax.methods.cmoe.convert import LayerRecord, check_plans, check_router, conversion_mesh, convert_model
from cmoe_jax.methods.cmoe.plan import MoEPlan
from cmoe_jax.methods.cmoe.report import write_report
from cmoe_jax.methods.cmoe.sensitivity import Measured, Sensitivity, measure_damage
from cmoe_jax.methods.cmoe.settings import ConvertSettings
from cmoe_jax.methods.cmoe.spread_choice import HELD_OUT_WINDOWS, BandRun, choose_band
from cmoe_jax.methods.method import Method
from cmoe_jax.methods.cmoe.streamed import Streamed, convert_streamed, measure_streamed
from cmoe_jax.methods.streamed_pass import save_conversion


def is_dense(cfg) -> bool:
    """A source without MoE layers (an MoE source is carved hierarchically)."""
    return all(s is None for s in cfg.moe_layers)


def check_context(cal: Calibration, cfg) -> None:
    """The calibration windows fit the model's context, and open as its own windows may."""
    cal.check_bos(cfg)
    if cal.seqlen > cfg.max_position_embeddings:
        raise CmoeError(f"--seqlen {cal.seqlen} exceeds the model's context "
                        f"({cfg.max_position_embeddings} positions)")


def stage_seconds(records, t_start: float, t_load: float, t_conv: float, t_save: float) -> dict:
    """The manifest's timings of a CMoE-family conversion (save added once saved)."""
    return {
        "load_model": t_conv - t_load,
        "prepare": t_load - t_start,
        "convert": t_save - t_conv,
        "profile": sum(r.seconds.get("profile", 0) + r.seconds.get("attention", 0) for r in records),
        "attention": sum(r.seconds.get("attention", 0) for r in records),  # part of profile
        "cluster": sum(r.seconds.get("cluster", 0) for r in records),
        "route_and_forward": sum(r.seconds.get("route_and_forward", 0) for r in records),
    }


def plan_entry(plan: MoEPlan | None, d_h: int, experts: int) -> dict:
    """One layer's shape in the manifest (a kept dense FFN: every expert shared, none routed)."""
    if plan is None:
        return {"shared": experts, "active": 0, "experts": experts, "expert_width": d_h // experts,
                "dense": True}
    return {"shared": plan.shared, "active": plan.active, "experts": plan.total,
            "expert_width": plan.expert_width(d_h)}


def layer_shapes(plans, extra=None) -> list[tuple[str, float]]:
    """(shape name, share of the dense FFN's work a token runs) of each layer of shapes
    `plans`: the share of its neurons, plus `extra(plan)` if given (`compensation_share`)."""
    return [("dense", 1.0) if p is None else
            (p.name, (p.shared + p.active) / p.total + (extra(p) if extra else 0.0)) for p in plans]


def active_share(plans, extra=None) -> float:
    """The mean of `layer_shapes`' shares over layers of shapes `plans`."""
    return float(np.mean([share for _, share in layer_shapes(plans, extra)]))


def compensation_share(cfg, cc: ConvertConfig):
    """plan -> the skipped experts' compensation's multiply-adds a token (`skip_down`: E r d;
    its h the router computes anyway) as a share of the dense FFN's 3 d d_h; None without one."""
    if not cc.skip_compensation:
        return None
    d_h = cfg.intermediate_size
    return lambda plan: plan.routed * cc.neurons_for(plan.expert_width(d_h)) / (3 * d_h)


def router_neurons(cfg, cc: ConvertConfig, plans) -> int | None:
    """The representative neurons per expert the carved layers got (None: none carved)."""
    carved = [p for p in plans if p is not None]
    return cc.neurons_for(carved[0].expert_width(cfg.intermediate_size)) if carved else None


def base_manifest(source_name: str, cfg, settings: ConvertSettings, records, bos: int | None = None) -> dict:
    """The manifest of a CMoE conversion (hierarchical CMoE updates some of its fields):
    `plan` has one entry per layer, `active_share` the mean share of the dense FFN's work a
    token runs (its neurons, plus the skipped experts' compensation when there is one);
    `bos`: the token that opened each calibration window, or None."""
    cc, cal = settings.method, settings.calibration
    plans = cc.layer_shapes(cfg.num_layers)
    extra = compensation_share(cfg, cc)
    experts = settings.budget.experts if settings.budget else cc.plan.total
    return {
        "source_model": source_name, "method": "cmoe", "config": cc.label,
        "plan": [plan_entry(p, cfg.intermediate_size, experts) for p in plans],
        "active_share": active_share(plans, extra),
        "budget": None if settings.budget is None else settings.budget.to_json(),
        "calibration": cal.manifest(cc.seed, bos),
        "k_act": cc.k_act, "normalize": cc.normalize, "kmeans_iters": cc.kmeans_iters,
        "shared_by": cc.shared_by,
        "router": {"neurons_per_expert": router_neurons(cfg, cc, plans), "fitted_scales": cc.router_scale,
                   "fit_tokens": cc.router_fit_tokens, "representatives_by": cc.router_reps,
                   "fitted_gates": cc.gate_fit, "routing": cc.routing},
        "down_fit": {"ridge": cc.down_fit, "tokens": cc.down_fit_tokens,
                     "skip_compensation": cc.skip_compensation},
        "layers": [dict(layer=i, shape=name, active_share=share,
                        **{k: v for k, v in r.to_json().items() if k not in ("mu", "seconds")})
                   for i, (r, (name, share)) in enumerate(zip(records, layer_shapes(plans, extra)))],
    }


def band_windows(cal: Calibration, tokens, seed: int, bos: int | None = None):
    """This process's share of the windows `--spread auto` scores the bands on (opened as
    the calibration windows are); an error before any work when the text holds too few
    beside the calibration windows."""
    held_out = cal.held_out(tokens, seed, HELD_OUT_WINDOWS, bos)
    if len(held_out) < distributed.process_count():
        raise CmoeError(f"--spread auto scores each band on windows of {cal.seqlen} tokens that no "
                        f"calibration window touches, and the calibration text holds "
                        f"{len(held_out)}: give a longer text, fewer --calib-samples, a smaller "
                        "--seqlen, or a fixed --spread N")
    return distributed.split_for_process(held_out)


def every_layer_dense(settings, num_layers: int):
    """The settings with no layer carved: what a budget of every neuron allocates."""
    method = dataclasses.replace(settings.method, plan=None, layer_plans=(None,) * num_layers)
    return dataclasses.replace(settings, method=method)


class CmoeSteps:
    """The job's steps of a CMoE conversion of a dense source (with a budget: first each
    layer's damage at every candidate shape, saved per layer for a resume, then the shapes)."""

    kind = "convert"
    resumable = ("layers/*.json", "damage/*.json", "gains/*.json", "bands/*.json")
    record = LayerRecord

    def __init__(self, settings: ConvertSettings):
        if settings.stream and settings.budget is not None:  # no band choice: a layer at a time
            settings = dataclasses.replace(settings, budget=settings.budget.streamed())
        self.settings = settings
        self.windows = self.moe_config = None  # the calibration windows; a streamed result's config
        self.bos = None  # the token opening each calibration window (`window_bos`), or None
        self.held_out = None  # windows no calibration window touches (`--spread auto`)
        self.sensitivity = self.band = None  # each layer's, with a budget; `--spread auto`'s choice
        self.band_seconds = 0.0

    def validate(self, source, options) -> None:
        s = self.settings
        distributed.refuse(**{"--resume": options.resume, "--stream": s.stream,
                              "an MoE source (hierarchical carving)": False})
        cfg, cc = source.config, s.method
        if s.budget is not None:
            check_budget(s.budget, cfg, cc)
        else:
            check_plans(cfg, cc)
            check_router(cfg, cc)
        # each process calibrates on its share of the windows (`cmoe_jax.distributed`)
        conversion_mesh(cc, len(distributed.split_for_process(range(s.calibration.samples))),
                        expert_parallel=s.expert_parallel)
        check_context(s.calibration, cfg)

    def fingerprint_settings(self, source) -> dict:
        budget = self.settings.budget
        return {"model": source.name, **self.settings.method.to_dict(),
                **self.settings.calibration.settings(),
                **({} if budget is None else budget.to_json())}

    def prepare(self, source):
        cal, seed = self.settings.calibration, self.settings.method.seed
        tokenizer = source.require_tokenizer("calibration text cannot be tokenized")
        self.bos = window_bos(source.config, tokenizer) if cal.bos else None  # `--calib-bos`
        tokens = cal.tokens(tokenizer)
        self.windows = distributed.split_for_process(cal.windows(tokens, seed, self.bos))
        if self.settings.budget is not None and self.settings.budget.spread == AUTO:
            self.held_out = band_windows(cal, tokens, seed, self.bos)
        return self.fingerprint_settings(source), tokens

    def carve(self, run, lm, done, on_layer):
        """(converted model or None when streamed into `run.final`, per-layer records)."""
        s = self.settings
        if s.stream:
            moe_config, records = convert_streamed(Streamed.of_job(run), self.windows, s.method,
                                                   progress=run.options.progress, done=done,
                                                   on_layer=on_layer, expert_parallel=s.expert_parallel)
            self.moe_config = moe_config
            return None, records
        return convert_model(lm.model, self.windows, s.method, progress=run.options.progress,
                             done=done, on_layer=on_layer, expert_parallel=s.expert_parallel)

    def load(self, run):
        if self.settings.stream:
            return None
        # layers kept one module each: the pass reads each where it lies (no slice copies)
        return run.source.load(dtype=jnp.float32, progress=run.options.progress, stack=False)

    def work(self, run):
        done, on_layer = run.json_layers(self.record.from_json)
        t_load = time.perf_counter()
        lm = self.load(run)
        t_conv = time.perf_counter()
        self.choose_shapes(run, lm)
        t_shapes = time.perf_counter()
        model, records = self.carve(run, lm, done, on_layer)
        seconds = stage_seconds(records, run.t_start, t_load, t_conv, time.perf_counter())
        if self.sensitivity is not None:
            seconds["measure_damage"] = t_shapes - t_conv - self.band_seconds
        if self.band is not None:
            seconds["choose_band"] = self.band_seconds
        return model, self.manifest(run.source, records), seconds, records

    def choose_shapes(self, run, lm) -> None:
        """With a budget: measure each layer's sensitivity to every candidate shape (each
        layer's figures saved in the staging directory as they come, read back on a resume; a
        streamed job reads the layers one at a time), then set the shapes."""
        budget = self.settings.budget
        if budget is None:
            return
        if budget.active >= 1:  # every neuron active: the one allocation is every layer dense
            self.settings = every_layer_dense(self.settings, run.source.config.num_layers)
            return
        errors, save_error = run.json_rows("damage")
        gains, save_gain = run.json_rows("gains")
        rises, save_rise = run.json_rows("rises")
        names = ["dense" if p is None else p.name for p in budget.candidates()]
        measured = Measured([r["stream_error"] for r in errors], [r["gain"] for r in gains],
                            on_error=lambda i, row: save_error(i, {"stream_error": row, "candidates": names}),
                            on_gain=lambda i, gain: save_gain(i, {"gain": gain}),
                            rises=[r["rise"] for r in rises], on_rise=lambda i, rise: save_rise(i, {"rise": rise}),
                            progress=run.options.progress)
        if self.settings.stream:  # the layers read one at a time, as the conversion reads them
            self.sensitivity = measure_streamed(Streamed.of_job(run), self.windows, self.settings.method,
                                                budget, measured=measured)
        else:
            self.sensitivity = measure_damage(lm.model, self.windows, self.settings.method, budget,
                                              measured=measured)
        if budget.spread == AUTO:
            t0 = time.perf_counter()
            method = self.choose_band(run, lm)
            self.band_seconds = time.perf_counter() - t0
        else:
            method = adaptive_config(self.settings.method, budget, self.sensitivity.damage())
        self.settings = dataclasses.replace(self.settings, method=method)

    def choose_band(self, run, lm) -> ConvertConfig:
        """`--spread auto`: each band's allocation converted and scored on the held-out
        windows (each band's loss saved as it comes), the best kept."""
        saved, save = run.json_rows("bands")
        s = self.settings
        self.band = choose_band(lm.model, s.method, s.budget, self.sensitivity.damage(),
                                BandRun(self.windows, self.held_out, saved, save, run.options.progress,
                                        s.expert_parallel))
        return dataclasses.replace(s.method, plan=None, layer_plans=tuple(self.band.plans))

    def manifest(self, source, records) -> dict:
        manifest = base_manifest(source.name, source.config, self.settings, records, self.bos)
        if self.sensitivity is not None:
            s = self.sensitivity
            manifest["budget"].update(damage=s.damage().tolist(), stream_error=s.errors.tolist(),
                                      loss_gain=None if s.gains is None else s.gains.tolist(),
                                      loss_rise=None if s.rises is None else s.rises.tolist())
        if self.band is not None:
            manifest["budget"].update(self.band.to_json())
        return manifest

    def interrupted(self, after: int) -> dict:
        return {"out": None, "config": self.settings.method.label, "interrupted_after": after}

    def save(self, run, model, manifest) -> None:
        save_conversion(run.final, model, manifest, run.source.tokenizer,
                        self.moe_config if self.settings.stream else None)

    def write_report(self, records, manifest, seconds, directory) -> None:
        shapes = [(layer["shape"], layer["active_share"]) for layer in manifest["layers"]]
        write_report(records, self.settings.method.label, seconds, directory, shapes)


# CMoE as the convert command registers it (`cmoe_jax.methods.registry`)
METHOD = Method(name="cmoe", command="convert", choices=("cmoe",), title="CMoE",
                summary="cmoe (CMoE; hierarchical when --model is an MoE)",
                settings=ConvertSettings, steps=CmoeSteps, add_flags=flags.add_flags,
                from_args=flags.settings_from_args, check_args=flags.check_args, takes_source=is_dense)

# the names of the conversion job other packages use (the package itself stays light)
__all__ = ["METHOD", "CmoeSteps", "ConvertSettings", "base_manifest", "check_context", "is_dense", "stage_seconds",
           "active_share", "plan_entry", "AUTO", "Budget", "adaptive_config", "Measured", "Sensitivity",
           "measure_damage", "HELD_OUT_WINDOWS", "BandRun", "choose_band", "Streamed", "convert_streamed"]

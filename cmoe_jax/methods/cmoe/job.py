"""CMoE as a job's steps (run by `cmoe_jax.jobs.run_job`): its settings, its checks against the
source, its calibration windows and fingerprint, the layer-by-layer conversion (in memory or
streamed), its manifest and its report."""
from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp

from cmoe_jax import distributed
from cmoe_jax.checkpoint import PER_LAYER, save_converted, write_manifest
from cmoe_jax.data import Calibration
from cmoe_jax.errors import CmoeError
from cmoe_jax.loading import open_source
from cmoe_jax.methods.cmoe.convert import (ConversionError, ConvertConfig, LayerRecord, check_router,
                                           conversion_mesh, convert_model)
from cmoe_jax.methods.cmoe.report import write_report
from cmoe_jax.methods.cmoe.streamed import Streamed, convert_streamed


@dataclasses.dataclass(frozen=True)
class ConvertSettings:
    """Everything a CMoE conversion needs besides its model and output: the method's
    settings, the calibration text, and how to run (the CLI builds it from its flags)."""

    method: ConvertConfig
    calibration: Calibration = Calibration()
    stream: bool = False  # read, convert and write one layer at a time (dense sources)
    expert_parallel: int = 1  # devices the routed experts are split over in the forward
    min_expert_tokens: int = 32  # hierarchical: fewer routed tokens -> profile on all tokens
    report: bool = False  # PNG plots and a JSON summary beside the model


def is_dense(cfg) -> bool:
    """A source without MoE layers (an MoE source is carved hierarchically)."""
    return all(s is None for s in cfg.moe_layers)


def check_context(cal: Calibration, cfg) -> None:
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


def base_manifest(source_name: str, cfg, settings: ConvertSettings, records) -> dict:
    """The manifest of a CMoE conversion (hierarchical CMoE updates some of its fields)."""
    cc, cal, plan = settings.method, settings.calibration, settings.method.plan
    return {
        "source_model": source_name, "method": "cmoe", "config": plan.name,
        "plan": {"shared": plan.shared, "active": plan.active, "experts": plan.total,
                 "expert_width": plan.expert_width(cfg.intermediate_size)},
        "calibration": cal.manifest(cc.seed),
        "k_act": cc.k_act, "normalize": cc.normalize, "kmeans_iters": cc.kmeans_iters,
        "shared_by": cc.shared_by,
        "router": {"neurons_per_expert": cc.router_neurons, "fitted_scales": cc.router_scale,
                   "fit_tokens": cc.router_fit_tokens, "representatives_by": cc.router_reps,
                   "fitted_gates": cc.gate_fit},
        "layers": [{k: v for k, v in r.to_json().items() if k not in ("mu", "seconds")}
                   for r in records],
    }


class CmoeSteps:
    """The job's steps of a CMoE conversion of a dense source."""

    kind = "convert"
    resumable = ("layers/*.json",)
    record = LayerRecord

    def __init__(self, settings: ConvertSettings):
        self.settings = settings
        self.windows = self.moe_config = None  # the calibration windows; a streamed result's config

    def validate(self, source, options) -> None:
        s = self.settings
        distributed.refuse(**{"--resume": options.resume, "--stream": s.stream,
                              "an MoE source (hierarchical carving)": False})
        cfg, cc = source.config, s.method
        try:
            cc.plan.validate(cfg.intermediate_size, cc.k_act)
        except ValueError as e:
            raise ConversionError(str(e)) from e
        check_router(cfg, cc)
        # each process calibrates on its share of the windows (`cmoe_jax.distributed`)
        conversion_mesh(cc, len(distributed.split_for_process(range(s.calibration.samples))),
                        expert_parallel=s.expert_parallel)
        check_context(s.calibration, cfg)

    def fingerprint_settings(self, source) -> dict:
        return {"model": source.name, **self.settings.method.to_dict(),
                **self.settings.calibration.settings()}

    def prepare(self, source):
        cal = self.settings.calibration
        tokens = cal.tokens(source.require_tokenizer("calibration text cannot be tokenized"))
        self.windows = distributed.split_for_process(cal.windows(tokens, self.settings.method.seed))
        return self.fingerprint_settings(source), tokens

    def carve(self, run, lm, done, on_layer):
        """(converted model or None when streamed into `run.final`, per-layer records)."""
        s, source = self.settings, run.source
        if s.stream:
            streamed = Streamed(source.source or open_source(source.path), source.config, run.final)
            moe_config, records = convert_streamed(streamed, self.windows, s.method, progress=run.options.progress,
                                                   done=done, on_layer=on_layer, expert_parallel=s.expert_parallel)
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
        model, records = self.carve(run, lm, done, on_layer)
        seconds = stage_seconds(records, run.t_start, t_load, t_conv, time.perf_counter())
        return model, self.manifest(run.source, records), seconds, records

    def manifest(self, source, records) -> dict:
        return base_manifest(source.name, source.config, self.settings, records)

    def interrupted(self, after: int) -> dict:
        return {"out": None, "config": self.settings.method.plan.name, "interrupted_after": after}

    def save(self, run, model, manifest) -> None:
        tokenizer = run.source.tokenizer
        if self.settings.stream:
            write_manifest(run.final, self.moe_config, dict(manifest, state_layout=PER_LAYER), tokenizer)
        else:
            save_converted(model, manifest, run.final, tokenizer=tokenizer)

    def write_report(self, records, manifest, seconds, directory) -> None:
        write_report(records, self.settings.method.plan.name, seconds, directory)

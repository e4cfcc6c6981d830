"""Hierarchical CMoE as a job's steps: CMoE's calibration, manifest and timings, with the
checks, the carving of every expert and the manifest fields of an MoE source."""
from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp

from cmoe_jax import distributed
from cmoe_jax.methods.cmoe import ConversionError
from cmoe_jax.methods.cmoe.job import CmoeSteps, check_context, stage_seconds
from cmoe_jax.methods.hierarchical.convert import (HierLayerRecord, convert_moe_model, manifest_fields,
                                                   validate_moe, with_sub_router)
from cmoe_jax.methods.hierarchical.report import write_hier_report


class HierarchicalSteps(CmoeSteps):
    """The job's steps of a CMoE conversion of an MoE source (each expert carved)."""

    record = HierLayerRecord

    def __init__(self, settings):
        super().__init__(dataclasses.replace(settings, method=with_sub_router(settings.method)))

    def validate(self, source, options) -> None:
        s = self.settings
        distributed.refuse(**{"--resume": options.resume, "--stream": s.stream,
                              "an MoE source (hierarchical carving)": True})
        if s.budget is not None:
            raise ConversionError(f"--active {s.budget.active:g} (a budget) carves a dense source; "
                                  "an MoE source takes a per-expert --config")
        validate_moe(source.config, s.method, s.min_expert_tokens)
        if s.expert_parallel > 1:
            raise ConversionError("--expert-parallel is not supported for an MoE source "
                                  "(hierarchical carving) yet: leave it at 1")
        if s.stream:
            raise ConversionError("--stream is not supported for an MoE source (hierarchical "
                                  "carving) yet: drop --stream")
        check_context(s.calibration, source.config)

    def fingerprint_settings(self, source) -> dict:
        return dict(super().fingerprint_settings(source), min_expert_tokens=self.settings.min_expert_tokens)

    def work(self, run):
        done, on_layer = run.json_layers(self.record.from_json)
        t_load = time.perf_counter()
        lm = run.source.load(dtype=jnp.float32, progress=run.options.progress, stack=False)
        t_conv = time.perf_counter()
        model, records = convert_moe_model(lm.model, self.windows, self.settings.method,
                                           progress=run.options.progress, done=done, on_layer=on_layer,
                                           min_tokens=self.settings.min_expert_tokens)
        seconds = stage_seconds(records, run.t_start, t_load, t_conv, time.perf_counter())
        seconds["carve"] = sum(r.seconds.get("carve", 0) for r in records)
        return model, self.manifest(run.source, records), seconds, records

    def manifest(self, source, records) -> dict:
        manifest = super().manifest(source, records)
        manifest.update(manifest_fields(source.config, self.settings.method, records,
                                        self.settings.min_expert_tokens))
        return manifest

    def write_report(self, records, manifest, seconds, directory) -> None:
        write_hier_report(records, self.settings.method.plan.name, seconds, directory)

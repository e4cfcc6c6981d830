"""End-to-end conversion job: arguments checked first, then load, calibrate, convert, save."""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import jax.numpy as jnp

from cmoe_jax import distributed
from cmoe_jax.checkpoint import MANIFEST, PER_LAYER, save_converted, write_json_atomic, write_manifest
from cmoe_jax.methods import hierarchical
from cmoe_jax.methods.cmoe import (ConversionError, ConvertConfig, LayerRecord, check_router,
                                       conversion_mesh, convert_model)
from cmoe_jax.methods.cmoe import convert_streamed
from cmoe_jax.data import calibration_windows, load_text_tokens
from cmoe_jax.errors import CmoeError
from cmoe_jax.jobs import JobModel, LayerLog, OutputJob, check_output_free, fingerprint
from cmoe_jax.loading import open_source


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The calibration text of a conversion: a corpus (or a local file) cut into windows."""

    dataset: str = "wikitext2"
    split: str = "validation"
    data_path: str | None = None
    samples: int = 8
    seqlen: int = 2048

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ConvertJob:
    """Everything a CMoE conversion job needs besides its model and output: the method's
    settings, the calibration text, and how to run (the CLI builds it from its flags)."""

    method: ConvertConfig
    calibration: Calibration = Calibration()
    stream: bool = False  # read, convert and write one layer at a time (dense sources)
    expert_parallel: int = 1  # devices the routed experts are split over in the forward
    min_expert_tokens: int = 32  # hierarchical: fewer routed tokens -> profile on all tokens
    report: bool = False  # PNG plots and a JSON summary beside the model


def convert(model: str, job: ConvertJob, *, out, resume: bool = False, overwrite: bool = False,
            progress: bool = True, stop_after_layers: int | None = None) -> dict:
    """Convert a dense checkpoint to CMoE as `job` says and save it at `out`; returns the manifest.

    `stop_after_layers` exists for testing interruption: the job stops (as if killed) once
    that many layers are saved in the staging directory. `job.expert_parallel`: see
    `convert_model`; it changes where work runs, not the result (dense sources only).

    An MoE `model` (a converted cmoe_jax MoE, Qwen3-MoE, Mixtral) is carved hierarchically:
    `job.method.plan` is then the per-expert plan S'A'E' (`cmoe_jax.methods.hierarchical`), each
    expert profiled on the tokens its router sends it, or all tokens below `min_expert_tokens`.

    `job.stream`: read, convert and write one decoder layer at a time
    (`cmoe_jax.methods.cmoe.convert_streamed`: peak host memory about one layer); dense sources only.
    """
    t_start = time.perf_counter()
    out = Path(out)
    check_output_free(out, overwrite)
    source = JobModel(model)
    cfg = source.config
    cc, cal, plan = job.method, job.calibration, job.method.plan
    stream, expert_parallel = job.stream, job.expert_parallel
    hier = hierarchical.is_moe(cfg)
    distributed.refuse(**{"--resume": resume, "--stream": stream,
                          "an MoE source (hierarchical carving)": hier})
    if hier:
        hierarchical.validate_moe(cfg, cc, job.min_expert_tokens)
        if expert_parallel > 1:
            raise ConversionError("--expert-parallel is not supported for an MoE source "
                                  "(hierarchical carving) yet: leave it at 1")
        if stream:
            raise ConversionError("--stream is not supported for an MoE source (hierarchical "
                                  "carving) yet: drop --stream")
    else:
        try:
            plan.validate(cfg.intermediate_size, cc.k_act)
        except ValueError as e:
            raise ConversionError(str(e)) from e
        check_router(cfg, cc)
        # each process calibrates on its share of the windows (`cmoe_jax.distributed`)
        conversion_mesh(cc, len(distributed.split_for_process(range(cal.samples))),
                        expert_parallel=expert_parallel)
    if cal.seqlen > cfg.max_position_embeddings:
        raise CmoeError(f"--seqlen {cal.seqlen} exceeds the model's context "
                        f"({cfg.max_position_embeddings} positions)")
    with OutputJob(out, "convert", overwrite=overwrite, resume=resume,
                   resumable=("layers/*.json",)) as output:
        return _convert(output, source, job, hier, progress=progress,
                        stop_after_layers=stop_after_layers, t_start=t_start)


def _convert(output: OutputJob, source: JobModel, job: ConvertJob, hier: bool, *, progress,
             stop_after_layers, t_start) -> dict:
    """The conversion once the output is locked: stage, convert layer by layer, publish."""
    model, cfg, path, out = source.name, source.config, source.path, output.out
    cc, cal, plan = job.method, job.calibration, job.method.plan
    stream, expert_parallel, min_expert_tokens = (job.stream, job.expert_parallel,
                                                   job.min_expert_tokens)
    tokenizer = source.require_tokenizer("calibration text cannot be tokenized")
    tokens = load_text_tokens(cal.dataset, tokenizer, split=cal.split, data_path=cal.data_path)
    windows = distributed.split_for_process(
        calibration_windows(tokens, cal.samples, cal.seqlen, cc.seed, flag="--calib-samples"))
    settings = {"model": str(model), **cc.to_dict(), "calib": cal.dataset, "calib_split": cal.split,
                "data_path": cal.data_path, "calib_samples": cal.samples, "seqlen": cal.seqlen}
    if hier:
        settings["min_expert_tokens"] = min_expert_tokens
    output.open(fingerprint("convert", settings, path, tokens))
    staging = output.staging.dir
    final = staging / "final"
    main = distributed.is_main()  # the one process that writes files besides Orbax's state
    layers = LayerLog(staging / "layers")
    done = []
    if main:
        done = layers.records((hierarchical.HierLayerRecord if hier else LayerRecord).from_json)
        shutil.rmtree(final, ignore_errors=True)
    distributed.barrier("convert:staging")
    t_load = time.perf_counter()
    if not stream:
        # layers kept one module each: the pass reads each where it lies (no slice copies)
        lm = source.load(dtype=jnp.float32, progress=progress, stack=False)
    t_conv = time.perf_counter()

    class _Stop(Exception):
        pass

    def on_layer(i, record):
        if main:
            layers.save_json(i, record.to_json())
        if stop_after_layers is not None and i + 1 >= stop_after_layers:
            raise _Stop()

    try:
        if hier:
            moe_model, records = hierarchical.convert_moe_model(
                lm.model, windows, cc, progress=progress, done=done, on_layer=on_layer,
                min_tokens=min_expert_tokens)
        elif stream:
            moe_model = None
            moe_config, records = convert_streamed(
                source.source or open_source(path), cfg, windows, cc, final, progress=progress, done=done,
                on_layer=on_layer, expert_parallel=expert_parallel)
        else:
            moe_model, records = convert_model(lm.model, windows, cc, progress=progress, done=done,
                                               on_layer=on_layer, expert_parallel=expert_parallel)
    except _Stop:
        return {"out": None, "config": plan.name, "interrupted_after": stop_after_layers}
    t_save = time.perf_counter()
    stage_seconds = {
        "load_model": t_conv - t_load,
        "prepare": t_load - t_start,
        "convert": t_save - t_conv,
        "profile": sum(r.seconds.get("profile", 0) + r.seconds.get("attention", 0) for r in records),
        "attention": sum(r.seconds.get("attention", 0) for r in records),  # part of profile
        "cluster": sum(r.seconds.get("cluster", 0) for r in records),
        "route_and_forward": sum(r.seconds.get("route_and_forward", 0) for r in records),
    }
    manifest = {
        "source_model": str(model), "method": "cmoe", "config": plan.name,
        "plan": {"shared": plan.shared, "active": plan.active, "experts": plan.total,
                 "expert_width": plan.expert_width(cfg.intermediate_size)},
        "calibration": {"dataset": cal.dataset, "split": cal.split, "data_path": cal.data_path,
                        "samples": cal.samples, "seqlen": cal.seqlen, "seed": cc.seed},
        "k_act": cc.k_act, "normalize": cc.normalize, "kmeans_iters": cc.kmeans_iters,
        "shared_by": cc.shared_by,
        "router": {"neurons_per_expert": cc.router_neurons, "fitted_scales": cc.router_scale,
                   "fit_tokens": cc.router_fit_tokens, "representatives_by": cc.router_reps},
        "layers": [{k: v for k, v in r.to_json().items() if k not in ("mu", "seconds")}
                   for r in records],
    }
    if hier:
        stage_seconds["carve"] = sum(r.seconds.get("carve", 0) for r in records)
        manifest.update(hierarchical.manifest_fields(cfg, cc, records, min_expert_tokens))
    if stream:
        write_manifest(final, moe_config, dict(manifest, state_layout=PER_LAYER), tokenizer)
    else:
        save_converted(moe_model, manifest, final, tokenizer=tokenizer)
    if job.report and hier and main:
        from cmoe_jax.methods.hierarchical import write_hier_report  # matplotlib: only with --report

        write_hier_report(records, plan.name, stage_seconds, final / "report")
    elif job.report and main:
        from cmoe_jax.methods.cmoe import write_report

        write_report(records, plan.name, stage_seconds, final / "report")
    stage_seconds["save"] = time.perf_counter() - t_save
    manifest["seconds"] = stage_seconds
    if main:
        write_json_atomic(final / MANIFEST,
                          dict(json.loads((final / MANIFEST).read_text()), seconds=stage_seconds))
    output.publish(final)
    distributed.barrier("convert:published")
    return dict(manifest, out=str(out))

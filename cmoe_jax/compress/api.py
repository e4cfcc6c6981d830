"""End-to-end compression job: arguments checked first, then load, calibrate, plan, save.

Like conversion, work happens in `<out>.partial/`: each MoE layer's calibration statistics
are saved there as it finishes (`--resume` continues from them), the finished model is
renamed to `<out>` at the end, so an interrupted run never leaves a half-written model.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import jax.numpy as jnp

from cmoe_jax.checkpoint import MANIFEST, save_converted, write_json_atomic
from cmoe_jax.methods.conmoe import METHODS as BASELINES, baseline_plans
from cmoe_jax.methods.conmoe import apply_plans, routed_bytes
from cmoe_jax.methods.conmoe import LayerStats, collect_stats
from cmoe_jax.methods.conmoe import conmoe_plans
from cmoe_jax.methods.conmoe import DISTANCES, DUPLICATE_GATES, SELECTIONS
from cmoe_jax.data import calibration_windows, load_text_tokens
from cmoe_jax.errors import CmoeError
from cmoe_jax.jobs import JobModel, LayerLog, OutputJob, check_output_free, fingerprint

METHODS = ("conmoe",) + BASELINES


@dataclasses.dataclass(frozen=True)
class CompressConfig:
    """What to do to the expert pool (the CLI builds it from its flags): the method and rho;
    for ConMoE the scope, prototype selection and distance; for every method how a token's
    gates on slots that now share an expert combine (`cmoe_jax.moe.prototypes`)."""

    method: str
    ratio: float
    scope: int = 1
    selection: str = "adaptive"
    distance: str = "weights"
    duplicate_gates: str = "sum"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_inputs(cfg, job: CompressConfig, seqlen) -> list[int]:
    """The MoE layers to compress; raise a CmoeError on anything that cannot run."""
    if job.method not in METHODS:
        raise CmoeError(f"--method {job.method!r} must be one of {', '.join(METHODS)}")
    if not 0.0 <= job.ratio < 1.0:
        raise CmoeError(f"--ratio {job.ratio} must be in [0, 1) (the share of routed experts removed)")
    if job.method != "conmoe" and (job.scope != 1 or job.selection != "adaptive" or job.distance != "weights"):
        raise CmoeError(f"--scope, --selection and --distance belong to --method conmoe, not {job.method}")
    if job.scope < 1:
        raise CmoeError(f"--scope {job.scope} must be at least 1 (MoE layers sharing a prototype pool)")
    for flag, value, allowed in (("--selection", job.selection, SELECTIONS), ("--distance", job.distance, DISTANCES),
                                 ("--duplicate-gates", job.duplicate_gates, DUPLICATE_GATES)):
        if value not in allowed:
            raise CmoeError(f"{flag} {value!r} must be one of {', '.join(allowed)}")
    specs = [(i, s) for i, s in enumerate(cfg.moe_layers or ()) if s is not None]
    if not specs:
        raise CmoeError("the model has no MoE layers: compress an MoE (convert a dense model "
                        "first with python -m cmoe_jax.convert)")
    if any(s.num_prototypes for _, s in specs):
        raise CmoeError("the model is already compressed (it has prototype layers): give the "
                        "original MoE")
    if len({(s.num_experts, s.expert_width, s.sub_experts) for _, s in specs}) > 1:
        raise CmoeError("the MoE layers differ in expert count or width: cmoe_jax.compress needs "
                        "identical MoE layers")
    if seqlen > cfg.max_position_embeddings:
        raise CmoeError(f"--seqlen {seqlen} exceeds the model's context "
                        f"({cfg.max_position_embeddings} positions)")
    return [i for i, _ in specs]


def make_plans(model, stats, job: CompressConfig):
    """The scope plans of `job` and figures about them (ConMoE's distances; none for baselines)."""
    if job.method == "conmoe":
        return conmoe_plans(model, stats, job.ratio, job.scope, job.selection, job.distance)
    return baseline_plans(job.method, stats, job.ratio, model), {}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def compress(model: str, config: CompressConfig, *, out, calib: str = "wikitext2", calib_split: str = "validation",
             data_path: str | None = None, calib_samples: int = 8, seqlen: int = 2048, seed: int = 0,
             resume: bool = False, overwrite: bool = False, report: bool = False,
             progress: bool = True, stop_after_layers: int | None = None) -> dict:
    """Compress an MoE model's routed experts and save it at `out`; returns the manifest.

    `stop_after_layers` exists for testing interruption (the job stops once that many
    layers' statistics are saved)."""
    t0 = time.perf_counter()
    out = Path(out)
    check_output_free(out, overwrite)
    source = JobModel(model)
    check_inputs(source.config, config, seqlen)
    with OutputJob(out, "compress", overwrite=overwrite, resume=resume,
                   resumable=("layers/*.npz",)) as job:
        tokenizer = source.require_tokenizer("calibration text cannot be tokenized")
        windows = calibration_windows(load_text_tokens(calib, tokenizer, split=calib_split,
                                                       data_path=data_path), calib_samples, seqlen, seed,
                                      flag="--calib-samples")
        # the statistics depend on the data only; the method and ratio act after them
        settings = {"model": str(model), "calib": calib, "calib_split": calib_split,
                    "data_path": data_path, "calib_samples": calib_samples, "seqlen": seqlen,
                    "seed": seed}
        job.open(fingerprint("compress", settings, source.path, windows))
        return _compress(job, source, windows, config, calib=calib, calib_split=calib_split,
                         data_path=data_path, calib_samples=calib_samples, seqlen=seqlen, seed=seed,
                         report=report, progress=progress, stop_after_layers=stop_after_layers, t0=t0)


def _compress(job: OutputJob, source: JobModel, windows, config: CompressConfig, *, calib,
              calib_split, data_path, calib_samples, seqlen, seed, report, progress,
              stop_after_layers, t0) -> dict:
    """The compression once the output is locked and staged: calibrate, plan, save, publish."""
    model, out, staging = source.name, job.out, job.staging.dir
    layers = LayerLog(staging / "layers")
    done = layers.arrays(LayerStats.from_npz)
    lm = source.load(dtype=jnp.float32, progress=progress)

    class _Stop(Exception):
        pass

    def on_layer(i, st):
        layers.save_arrays(i, st.to_npz())
        if stop_after_layers is not None and layers.count() >= stop_after_layers:
            raise _Stop()

    try:
        stats = collect_stats(lm.model, windows, done=done, on_layer=on_layer, progress=progress)
    except _Stop:
        return {"out": None, "interrupted_after": stop_after_layers}
    t_cal = time.perf_counter()
    if config.ratio == 0.0:  # nothing removed: the model itself
        plans, figures, compressed = [], {}, lm.model
    else:
        plans, figures = make_plans(lm.model, stats, config)
        compressed = apply_plans(lm.model, plans, config.duplicate_gates)
    manifest = {
        "source_model": str(model), "method": "compress", "compression": {
            **config.to_dict(),
            "routed_experts": int(sum(len(s.freq) for s in stats.values())),
            "prototypes": int(sum(p.num_prototypes for p in plans)) if plans
            else int(sum(len(s.freq) for s in stats.values())),
            "routed_bytes_before": routed_bytes(lm.model), "routed_bytes_after": routed_bytes(compressed),
            **figures},
        "calibration": {"dataset": calib, "split": calib_split, "data_path": data_path,
                        "samples": calib_samples, "seqlen": seqlen, "seed": seed},
        "scopes": [p.to_json() for p in plans],
        "layer_stats": {str(l): {"freq": s.freq.tolist(), "contrib": s.contrib.tolist()}
                        for l, s in stats.items()},
    }
    final = staging / "final"
    shutil.rmtree(final, ignore_errors=True)
    save_converted(compressed, manifest, final, tokenizer=lm.tokenizer)
    if report:
        from cmoe_jax.methods.conmoe import write_report  # matplotlib: only with --report

        write_report(plans, stats, manifest["compression"], final / "report")
    seconds = {"calibrate": t_cal - t0, "total": time.perf_counter() - t0}
    manifest["compression"]["state_disk_bytes"] = dir_bytes(final / "state")
    manifest["seconds"] = seconds
    write_json_atomic(final / MANIFEST, dict(json.loads((final / MANIFEST).read_text()),
                                             compression=manifest["compression"], seconds=seconds))
    job.publish(final)
    return dict(manifest, out=str(out))

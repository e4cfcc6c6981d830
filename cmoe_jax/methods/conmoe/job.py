"""Compression of an MoE's expert pool as a job's steps (run by `cmoe_jax.jobs.run_job`):
its settings, checks, calibration statistics per MoE layer, the plans, manifest and report.

The statistics depend on the calibration data only (the method and rho act after them), so
a resumed run keeps each saved layer's statistics whatever the method."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax.numpy as jnp

from cmoe_jax.data import Calibration
from cmoe_jax.errors import CmoeError
from cmoe_jax.loading import window_bos
from cmoe_jax.methods.conmoe.baselines import METHODS as BASELINES, baseline_plans
from cmoe_jax.methods.conmoe.build import apply_plans, routed_bytes, state_bytes
from cmoe_jax.methods.conmoe.expert_stats import LayerStats, collect_stats
from cmoe_jax.methods.conmoe.plan import conmoe_plans, scopes_of
from cmoe_jax.methods.conmoe.report import write_report
from cmoe_jax.methods.conmoe.scoring import DISTANCES, SELECTIONS
from cmoe_jax.moe.prototypes import DUPLICATE_GATES

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


@dataclasses.dataclass(frozen=True)
class CompressSettings:
    """Everything a compression needs besides its model and output."""

    method: CompressConfig
    calibration: Calibration = Calibration()
    seed: int = 0  # the calibration windows' draw
    report: bool = False  # PNG plots and report.json beside the model


def check_config(job: CompressConfig) -> None:
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


def check_inputs(cfg, job: CompressConfig, seqlen) -> list[int]:
    """The MoE layers to compress; raise a CmoeError on anything that cannot run."""
    check_config(job)
    specs = [(i, s) for i, s in enumerate(cfg.moe_layers or ()) if s is not None]
    if not specs:
        raise CmoeError("the model has no MoE layers: compress an MoE (convert a dense model "
                        "first with python -m cmoe_jax.convert)")
    if any(s.num_prototypes for _, s in specs):
        raise CmoeError("the model is already compressed (it has prototype layers): give the "
                        "original MoE")
    check_scopes(dict(specs), job)
    if seqlen > cfg.max_position_embeddings:
        raise CmoeError(f"--seqlen {seqlen} exceeds the model's context "
                        f"({cfg.max_position_embeddings} positions)")
    return [i for i, _ in specs]


def check_scopes(specs: dict, job: CompressConfig) -> None:
    """The MoE layers of one scope share one prototype table, so their experts must have one
    shape (width, sub-experts); their counts may differ (a per-layer conversion's routed
    experts). Dense layers between them are not compressed and stay as they are."""
    for layers in scopes_of(sorted(specs), job.scope):
        shapes = {(specs[l].expert_width, specs[l].sub_experts) for l in layers}
        if len(shapes) > 1:
            raise CmoeError(f"the MoE layers {layers} of one --scope {job.scope} differ in expert "
                            "width or sub-experts, so they cannot share one prototype table: use "
                            "a smaller --scope (1 compresses each layer on its own)")


def make_plans(model, stats, job: CompressConfig):
    """The scope plans of `job` and figures about them (ConMoE's distances; none for baselines)."""
    if job.method == "conmoe":
        return conmoe_plans(model, stats, job.ratio, job.scope, job.selection, job.distance)
    return baseline_plans(job.method, stats, job.ratio, model), {}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


class CompressSteps:
    """The job's steps of compressing an MoE's routed experts (ConMoE or a baseline)."""

    kind = "compress"
    resumable = ("layers/*.npz",)

    def __init__(self, settings: CompressSettings):
        self.settings = settings
        self.windows = self.bos = None  # the calibration windows; the token opening each, or None

    def validate(self, source, options) -> None:
        check_inputs(source.config, self.settings.method, self.settings.calibration.seqlen)
        self.settings.calibration.check_bos(source.config)

    def prepare(self, source):
        cal, seed = self.settings.calibration, self.settings.seed
        tokenizer = source.require_tokenizer("calibration text cannot be tokenized")
        self.bos = window_bos(source.config, tokenizer) if cal.bos else None  # `--calib-bos`
        self.windows = cal.windows(cal.tokens(tokenizer), seed, self.bos)
        # the statistics depend on the data only; the method and ratio act after them
        return {"model": source.name, **cal.settings(), "seed": seed}, self.windows

    def work(self, run):
        config = self.settings.method
        done, on_layer = run.array_layers(LayerStats.from_npz)
        lm = run.source.load(dtype=jnp.float32, progress=run.options.progress)
        stats = collect_stats(lm.model, self.windows, done=done, on_layer=on_layer,
                              progress=run.options.progress)
        seconds = {"calibrate": time.perf_counter() - run.t_start}
        if config.ratio == 0.0:  # nothing removed: the model itself
            plans, figures, compressed = [], {}, lm.model
        else:
            plans, figures = make_plans(lm.model, stats, config)
            compressed = apply_plans(lm.model, plans, config.duplicate_gates)
        # the arrays' bytes, not the size of Orbax's files: OCDBT packs its chunks into data
        # files by the order its concurrent writes finish, so that size changes from run to run
        figures["state_array_bytes"] = state_bytes(compressed)
        manifest = self.manifest(run.source.name, stats, plans, figures,
                                 (routed_bytes(lm.model), routed_bytes(compressed)))
        return compressed, manifest, seconds, (plans, stats)

    def manifest(self, source_name, stats, plans, figures, routed) -> dict:
        routed_experts = int(sum(len(s.freq) for s in stats.values()))
        return {
            "source_model": source_name, "method": "compress", "compression": {
                **self.settings.method.to_dict(), "routed_experts": routed_experts,
                "prototypes": int(sum(p.num_prototypes for p in plans)) if plans else routed_experts,
                "routed_bytes_before": routed[0], "routed_bytes_after": routed[1], **figures},
            "calibration": self.settings.calibration.manifest(self.settings.seed, self.bos),
            "scopes": [p.to_json() for p in plans],
            "layer_stats": {str(l): {"freq": s.freq.tolist(), "contrib": s.contrib.tolist()}
                            for l, s in stats.items()},
        }

    def interrupted(self, after: int) -> dict:
        return {"out": None, "interrupted_after": after}

    def write_report(self, extra, manifest, seconds, directory) -> None:
        plans, stats = extra
        write_report(plans, stats, manifest["compression"], directory)

    def finish(self, run, manifest, seconds) -> dict:
        seconds["total"] = time.perf_counter() - run.t_start
        return {"compression": manifest["compression"], "seconds": seconds}

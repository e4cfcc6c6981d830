"""`export`: a cmoe_jax model (converted, fine-tuned, or any checkpoint it loads) written as a
Hugging Face directory: sharded safetensors, `config.json`, the tokenizer, and for carved MoE
layers the remote code `modeling_cmoe.py`.

Written into `OUT.partial/final/` one shard at a time (each finished shard is recorded with
its sha256, so `--resume` keeps it only when the file still matches and the source model and
settings are the ones the export started from) and renamed to `OUT` at the end. With torch
installed, the exported directory is then loaded with transformers and its logits on the
verification windows compared to ours: beyond `verify.LOGIT_TOLERANCE` the export fails and
nothing is published.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save
from tqdm.auto import tqdm

from cmoe_jax.atomic_files import write_json_atomic
from cmoe_jax.errors import CmoeError
from cmoe_jax.export.hf_config import (REMOTE_CODE, ExportError, hf_config, keeps_original_architecture,
                                      remote_code)
from cmoe_jax.export.hf_weights import hf_tensors
from cmoe_jax.export.verify import compare_with_transformers, require_match, verification_windows
from cmoe_jax.jobs import Job, JobRun, Outcome, RunOptions, SourceModel, fault_point, file_digest, run_job
from cmoe_jax.models.stack import layered_state

EXPORT_MANIFEST = "cmoe_export.json"
FORMATS = ("hf",)


def _shard_plan(cfg, state, max_shard_bytes: int) -> list[list[tuple]]:
    """Parameter paths grouped into shards of at most `max_shard_bytes` (one big tensor alone)."""
    shards, current, size = [], [], 0
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        nbytes = int(np.prod(value.shape)) * np.dtype(value.dtype).itemsize
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(tuple(path))
        size += nbytes
    return shards + [current] if current else shards


SHARD_TMP = "shard.tmp"  # in the staging directory, outside final/: publish never takes it
SHARD_RECORD = "shards.json"  # in the staging directory: {shard file name: sha256}


def _write_shard(cfg, values: dict, paths, file: Path, tmp: Path) -> dict:
    """Write one safetensors shard (readable by all, as the JSON files) at `tmp`, then
    rename it to `file`; returns {tensor name: file name}."""
    tensors = {}
    for path in paths:
        for name, array in hf_tensors(cfg, path, values):
            tensors[name] = np.ascontiguousarray(array)
    data = memoryview(save(tensors, metadata={"format": "pt"}))
    with open(tmp, "wb") as f:
        os.fchmod(f.fileno(), 0o644)
        for start in range(0, len(data), 1 << 24):
            f.write(data[start:start + (1 << 24)])
            fault_point("shard:write")  # the fault campaign kills inside a shard here
    tmp.replace(file)
    return {name: file.name for name in tensors}


@dataclasses.dataclass(frozen=True)
class ExportSettings:
    """What an export writes (`fmt`, shards of at most `max_shard_mb` MiB) and the windows the
    exported model is checked on against ours (`calib*`, `data_path`, `seqlen`, `seed`;
    `calib_samples=0`: no check)."""

    fmt: str = "hf"
    calib: str = "wikitext2"
    calib_split: str = "validation"
    data_path: str | None = None
    calib_samples: int = 2
    seqlen: int = 512
    seed: int = 0
    max_shard_mb: float = 2048

    def check(self) -> None:
        if self.fmt not in FORMATS:
            raise CmoeError(f"--format {self.fmt!r} is not one of {', '.join(FORMATS)}")

    def check_sizes(self) -> None:
        if not (math.isfinite(self.max_shard_mb) and self.max_shard_mb > 0) or self.calib_samples < 0 \
                or self.seqlen < 2:
            raise CmoeError("--max-shard-mb must be positive, --calib-samples >= 0 and --seqlen >= 2")


class ExportJob(Job):
    """An export as a job (`cmoe_jax.jobs.run_job`): its units of work are the shards, its
    manifest the export record (written whole by `save`); `final/` keeps the shards a resume
    reuses."""

    kind, resumable, fresh_final, manifest_name = "export", (SHARD_RECORD,), False, None

    def __init__(self, settings: ExportSettings):
        self.settings = settings

    def check(self) -> None:
        self.settings.check()

    def validate(self, source: SourceModel, options: RunOptions) -> None:
        self.settings.check_sizes()
        self.config_json = hf_config(source.config)  # a model the format cannot hold fails here

    def prepare(self, source: SourceModel) -> tuple[dict, object]:
        s, windows = self.settings, None
        if s.calib_samples:
            windows = verification_windows(source, s.calib, s.calib_split, s.data_path, s.calib_samples,
                                           s.seqlen, s.seed)
        self.windows = windows
        return {"model": source.name, "format": s.fmt, "max_shard_mb": s.max_shard_mb}, windows

    def work(self, run: JobRun) -> Outcome:
        return Outcome(None, _export(run, self.settings, self.config_json, self.windows))

    def save(self, run: JobRun, outcome: Outcome) -> None:
        outcome.manifest["seconds"] = time.perf_counter() - run.t_start
        write_json_atomic(run.final / EXPORT_MANIFEST, outcome.manifest)

    def result(self, outcome: Outcome, out: Path) -> dict:
        return dict(outcome.manifest, out=str(out))


def export(model: str, settings: ExportSettings = ExportSettings(), *, out, overwrite: bool = False,
           resume: bool = False, progress: bool = True, stop_after_shards: int | None = None) -> dict:
    """Export `model` to `out` under `settings`; returns the export record (also
    `out/cmoe_export.json`). `stop_after_shards` exists for testing interruption."""
    options = RunOptions(resume, overwrite, progress, stop_after=stop_after_shards)
    return run_job(ExportJob(settings), model, out, options)


def _staged_shards(staging: Path, final: Path) -> dict:
    """Shards an interrupted export finished: each file must still have its recorded digest."""
    path = staging / SHARD_RECORD
    done = json.loads(path.read_text()) if path.exists() else {}
    for name, digest in done.items():
        if (final / name).exists() and file_digest(final / name) != digest:
            raise ExportError(f"--resume: the staged shard {final / name} differs from the one "
                              "recorded when it was written; rerun without --resume to start over")
    done = {n: d for n, d in done.items() if (final / n).exists()}
    for p in final.iterdir():  # anything else (a half-written file) is not kept, never published
        if p.name not in done:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    (staging / SHARD_TMP).unlink(missing_ok=True)
    return done


def _export(run: JobRun, settings: ExportSettings, config_json: dict, windows) -> dict:
    """Shards (each one a unit of work: `run.unit_saved`), config, tokenizer and the check
    into the staging directory; the record."""
    staging, final = run.output.staging.dir, run.final
    final.mkdir(exist_ok=True)
    done = _staged_shards(staging, final)
    lm = run.source.load(progress=run.options.progress)
    cfg = lm.config
    state = layered_state(lm.model)  # tensors per layer, as Hugging Face names them
    values = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(state)}
    plan = _shard_plan(cfg, state, int(settings.max_shard_mb * 2**20))
    weight_map: dict[str, str] = {}
    for k, paths in enumerate(tqdm(plan, desc="writing shards", disable=not run.options.progress)):
        file = final / f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors"
        if file.name in done:
            with safe_open(str(file), "np") as f:
                weight_map.update({name: file.name for name in f.keys()})
            continue
        weight_map.update(_write_shard(cfg, values, paths, file, staging / SHARD_TMP))
        done[file.name] = file_digest(file)
        write_json_atomic(staging / SHARD_RECORD, done)
        fault_point("shard")
        run.unit_saved(len(done))
    if len(plan) == 1:
        (final / next(iter(done))).replace(final / "model.safetensors")
    else:
        total = sum(int(np.prod(v.shape)) * 4 for v in values.values())
        write_json_atomic(final / "model.safetensors.index.json",
                          {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json_atomic(final / "config.json", config_json)
    if not keeps_original_architecture(cfg):
        (final / REMOTE_CODE).write_text(remote_code(cfg))
    if lm.tokenizer is not None:
        lm.tokenizer.hf.save_pretrained(str(final))
    record = {"source_model": run.source.name, "format": settings.fmt,
              "architecture": config_json["architectures"][0],
              "remote_code": not keeps_original_architecture(cfg), "shards": len(plan),
              "tensors": len(weight_map)}
    if windows is not None:
        record["verification"] = require_match(compare_with_transformers(lm.model, final, windows))
    return record


__all__ = ["export", "ExportSettings", "ExportError", "EXPORT_MANIFEST"]

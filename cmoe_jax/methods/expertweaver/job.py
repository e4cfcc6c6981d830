"""ExpertWeaver as a job's steps (run by `cmoe_jax.jobs.run_job`): its settings, calibration
tasks (WikiText articles, or a task-diverse mix), the layer-by-layer weave (in memory or
streamed), manifest, report."""
from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp
import numpy as np

from cmoe_jax.errors import CmoeError
from cmoe_jax.methods.expertweaver.calib_tasks import arc_text, task_windows, wikitext_articles
from cmoe_jax.methods.expertweaver.convert import WeaveConfig, validate, weave_model, weave_streamed
from cmoe_jax.methods.expertweaver.report import write_report
from cmoe_jax.methods.streamed_pass import Streamed, save_conversion
from cmoe_jax.methods.expertweaver.task_mix import diverse_task_windows

MIXES = ("wikitext", "diverse")
DIVERSE_NEEDS_ARC = ("--calib-mix diverse needs --arc-path: ARC-Easy JSON lines (its questions make four of the "
                     "seven pseudo-task formats)")
DEFAULT_TASKS = {"wikitext": 32, "diverse": 42}


@dataclasses.dataclass(frozen=True)
class TaskCalibration:
    """ExpertWeaver's calibration: tasks of `samples_per_task` windows of `seqlen` tokens.
    `tasks` None: 32 WikiText articles (`mix` "wikitext") or 42 pseudo-tasks ("diverse")."""

    data_path: str | None = None
    arc_path: str | None = None
    tasks: int | None = None
    samples_per_task: int = 2
    seqlen: int = 256
    mix: str = "wikitext"

    def check(self) -> None:
        if self.mix not in MIXES:
            raise CmoeError(f"--calib-mix {self.mix!r} must be one of {', '.join(MIXES)}")
        if not self.data_path:
            raise CmoeError("--method expertweaver needs --data-path: the raw WikiText-2 validation file "
                            "(its articles are the calibration tasks)")
        if self.mix == "diverse" and not self.arc_path:
            raise CmoeError(DIVERSE_NEEDS_ARC)

    @property
    def task_count(self) -> int:
        return DEFAULT_TASKS[self.mix] if self.tasks is None else self.tasks


@dataclasses.dataclass(frozen=True)
class WeaverSettings:
    """Everything an ExpertWeaver conversion needs besides its model and output."""

    method: WeaveConfig
    calibration: TaskCalibration = TaskCalibration()
    report: bool = False
    stream: bool = False  # read, weave and write one decoder layer at a time

    def check(self) -> None:
        self.calibration.check()


def calibration_tasks(tokenizer, cal: TaskCalibration, seed: int = 0):
    """(windows [N, seqlen], task ids [N], task names). `mix` "wikitext": WikiText-2 articles,
    then ARC-Easy as one task; "diverse": pseudo-tasks of seven formats (`task_mix.py`)."""
    tasks, per_task, seqlen = cal.task_count, cal.samples_per_task, cal.seqlen
    if cal.mix == "diverse":
        return diverse_task_windows(tokenizer, cal.data_path, cal.arc_path, tasks, per_task, seqlen, seed)
    windows, ids = task_windows(wikitext_articles(cal.data_path), tokenizer, per_task, seqlen, tasks)
    names = [f"wikitext article {t}" for t in range(int(ids.max()) + 1)]
    if cal.arc_path:
        arc_w, _ = task_windows([arc_text(cal.arc_path)], tokenizer, per_task, seqlen, 1)
        windows = np.concatenate([windows, arc_w])
        ids = np.concatenate([ids, np.full(len(arc_w), len(names), np.int32)])
        names.append("arc-easy")
    if len(names) < 2:
        raise CmoeError("ExpertWeaver needs at least 2 calibration tasks: raise --calib-tasks or add "
                        "--arc-path")
    return windows, ids, names


class WeaverSteps:
    """The job's steps of an ExpertWeaver conversion of a dense source."""

    kind = "convert-expertweaver"
    resumable = ("layers/*.json",)

    def __init__(self, settings: WeaverSettings):
        self.settings = settings
        self.windows = self.task_ids = self.names = None
        self.moe_config = None  # a streamed result's config

    def validate(self, source, options) -> None:
        cfg, seqlen = source.config, self.settings.calibration.seqlen
        validate(cfg, self.settings.method)
        if seqlen > cfg.max_position_embeddings:
            raise CmoeError(f"--seqlen {seqlen} exceeds the model's context ({cfg.max_position_embeddings})")

    def prepare(self, source):
        cc, cal = self.settings.method, self.settings.calibration
        tokenizer = source.require_tokenizer("calibration text cannot be tokenized")
        self.windows, self.task_ids, self.names = calibration_tasks(tokenizer, cal, cc.seed)
        settings = {"model": source.name, **cc.to_dict(), "data_path": cal.data_path,
                    "arc_path": cal.arc_path, "tasks": cal.task_count,
                    "samples_per_task": cal.samples_per_task, "seqlen": cal.seqlen}
        if cal.mix != "wikitext":  # the default keeps the fingerprint of earlier runs
            settings["calib_mix"] = cal.mix
        return settings, [self.windows, self.task_ids]

    def work(self, run):
        cc = self.settings.method
        done, on_layer = run.json_layers(dict)
        t_conv = time.perf_counter()
        if self.settings.stream:
            self.moe_config, records = weave_streamed(Streamed.of_job(run), self.windows, self.task_ids, cc,
                                                      progress=run.options.progress, done=done,
                                                      on_layer=on_layer)
            model = None  # written into `run.final` layer by layer
        else:
            lm = run.source.load(dtype=jnp.float32, progress=run.options.progress, stack=False)
            t_conv = time.perf_counter()
            model, records = weave_model(lm.model, self.windows, self.task_ids, cc,
                                         progress=run.options.progress, done=done, on_layer=on_layer)
        seconds = {"prepare_and_load": t_conv - run.t_start, "convert": time.perf_counter() - t_conv,
                   "profile": sum(r["seconds"]["profile"] for r in records),
                   "cluster": sum(r["seconds"]["cluster"] for r in records)}
        return model, self.manifest(run.source, records), seconds, records

    def manifest(self, source, records) -> dict:
        cc, cal = self.settings.method, self.settings.calibration
        return {
            "source_model": source.name, **cc.to_dict(), "config": cc.name, "active_experts": cc.active,
            "active_share": cc.active / cc.experts,  # the budget met, as `convert --active F` records it
            "expert_width": source.config.intermediate_size // cc.experts,
            "calibration": {"mix": cal.mix, "wikitext_path": cal.data_path, "arc_path": cal.arc_path,
                            "tasks": self.names, "samples_per_task": cal.samples_per_task,
                            "seqlen": cal.seqlen},
            "layers": [{k: r[k] for k in ("alpha", "r", "n_shared", "shared", "experts",
                                          "kmeans_iterations", "cv_quantiles", "load")} for r in records],
        }

    def interrupted(self, after: int) -> dict:
        return {"out": None, "config": self.settings.method.name, "interrupted_after": after}

    def save(self, run, model, manifest) -> None:
        save_conversion(run.final, model, manifest, run.source.tokenizer,
                        self.moe_config if self.settings.stream else None)

    def write_report(self, records, manifest, seconds, directory) -> None:
        write_report(records, self.settings.method.name, directory, manifest["calibration"])

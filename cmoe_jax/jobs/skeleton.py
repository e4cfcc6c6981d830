"""The one path every output-writing job takes, written once:

    validate -> stage -> run (units of work saved, stop, resume) -> save -> manifest -> publish

A job fills in a `Job` (its kind, what a resume keeps, its checks, its data and fingerprint
settings, its work and its manifest) and `run_job` drives it: nothing is touched before the
checks pass, the staging directory is verified against the fingerprint on `--resume`, the
finished output is written into `OUT.partial/final`, the manifest gets its timings, and the
directory is renamed to `--out` (`OutputDir`). An error leaves through `OutputDir`, which
discards the staging directory unless it holds resumable work. A unit of work is what a job
saves as it goes and a resume keeps: a layer (convert, compress), a shard (export), a
step's checkpoint (train, downcycle). Before anything is read, the paths the job writes are
checked apart from those it reads (`jobs.apart`) and its inputs are stamped (`InputWatch`,
checked again just before publishing); the source's readers' lock is held throughout.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from pathlib import Path

from cmoe_jax import distributed
from cmoe_jax.atomic_files import write_json_atomic
from cmoe_jax.checkpoint import MANIFEST, reading, save_converted
from cmoe_jax.checkpoint.seal import write_sealed
from cmoe_jax.jobs.apart import check_apart, declared_inputs, output_paths
from cmoe_jax.jobs.fingerprint import InputWatch, fingerprint
from cmoe_jax.jobs.output import OutputDir, check_output_free
from cmoe_jax.jobs.progress import LayerLog
from cmoe_jax.jobs.source import SourceModel


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How a job runs, whatever it does: `stop_after` exists for testing interruption (the
    job stops, as if killed, once that many units of work (layers, shards, steps) are saved
    in its staging directory)."""

    resume: bool = False
    overwrite: bool = False
    progress: bool = True
    stop_after: int | None = None


class Interrupted(Exception):
    """Raised by `JobRun.unit_saved` (or a job's work) once `stop_after` units are saved;
    `after`: what the interrupted result reports."""

    def __init__(self, after: int):
        super().__init__(after)
        self.after = after


@dataclasses.dataclass
class Outcome:
    """What a job's work produced: the model to save (None when the work wrote it itself),
    its manifest and the seconds of its stages so far."""

    model: object
    manifest: dict
    seconds: dict = dataclasses.field(default_factory=dict)
    extra: object = None  # whatever the job's report needs (per-layer records, plans, ...)


class JobRun:
    """A job's view of its locked, staged output while it works: the source, the per-layer
    log under the staging directory, the directory the finished model goes to, the clock."""

    def __init__(self, output: OutputDir, source: SourceModel, options: RunOptions, t_start: float,
                 watch: InputWatch | None = None):
        self.output, self.source, self.options, self.t_start = output, source, options, t_start
        self.watch = watch or InputWatch({})  # the inputs, checked unchanged before publishing
        self.main = distributed.is_main()  # the one process that writes files besides Orbax's state
        self.layers = LayerLog(output.staging.dir / "layers")
        self.final = output.staging.dir / "final"

    def unit_saved(self, count: int) -> None:
        """Called once a unit of work (a layer, a shard) is saved; `count`: units saved so far
        (resumed ones included). Raises `Interrupted` when `stop_after` says so."""
        stop = self.options.stop_after
        if stop is not None and count >= stop:
            raise Interrupted(stop)

    def json_layers(self, parse=dict):
        """(records saved before, on_layer) for a job whose layers log JSON records in order:
        `on_layer(i, record)` saves layer `i` (process 0 only) and applies the stop hook."""
        done = self.layers.records(parse) if self.main else []

        def on_layer(i, record):
            if self.main:
                self.layers.save_json(i, record if isinstance(record, dict) else record.to_json())
            self.unit_saved(i + 1)

        return done, on_layer

    def json_rows(self, name: str):
        """(rows saved before, save(i, row)) of a per-layer JSON log `name` under the staging
        directory besides the layers' (a measurement a resume keeps): process 0 writes."""
        log = LayerLog(self.output.staging.dir / name)
        done = log.records() if self.main else []

        def save(i, row):
            if self.main:
                log.save_json(i, row)

        return done, save

    def array_layers(self, parse):
        """({layer: parse(npz)} saved before, on_layer) for a job whose layers save arrays
        (`record.to_npz()`); the stop hook counts the layers saved."""
        done = self.layers.arrays(parse)

        def on_layer(i, record):
            self.layers.save_arrays(i, record.to_npz())
            self.unit_saved(self.layers.count())

        return done, on_layer


class Job:
    """What a job fills in; `run_job` calls these in order. Defaults suit a converting job."""

    kind = ""  # the lock's and the fingerprint's job name, e.g. "convert"
    resumable: tuple[str, ...] = ("layers/*.json",)  # staged globs a failed run keeps for --resume
    report = False  # write `write_report` output into the model's report/ directory
    manifest_name = MANIFEST  # the file in `run.final` that `finish`'s fields are written into
    # (None: `save` writes the job's record whole, and `finish` is not called)
    fresh_final = True  # remove an unfinished `final/` of a killed run before working
    output_hint = ""  # added to the "output directory exists" error

    def output_may_exist(self, options: RunOptions) -> bool:
        """Whether `--out` may exist already (e.g. a training run resumed in place)."""
        return options.overwrite

    def check(self) -> None:
        """Settings-only checks, before the output or the source is looked at."""

    def validate(self, source: SourceModel, options: RunOptions) -> None:
        """Checks against the opened source; nothing is written yet."""

    def prepare(self, source: SourceModel) -> tuple[dict, object]:
        """Once the output is locked: read the data; returns (fingerprint settings, data)."""
        return {}, None

    def open(self, output: OutputDir, fingerprint: dict) -> None:
        """Make or verify the staging directory (a job with files of its own overrides it,
        with `output.on_main`)."""
        output.open(fingerprint)

    def work(self, run: JobRun) -> Outcome:
        """The job's work; per-layer results through `run.json_layers` / `run.array_layers`."""
        raise NotImplementedError

    def interrupted(self, after: int) -> dict:
        """The result of a run stopped by `stop_after` (`after`: `Interrupted.after`)."""
        return {"out": None, "interrupted_after": after}

    def save(self, run: JobRun, outcome: Outcome) -> None:
        """Write the finished model into `run.final` (process 0 and Orbax's writers)."""
        save_converted(outcome.model, outcome.manifest, run.final, tokenizer=run.source.tokenizer)

    def write_report(self, outcome: Outcome, directory: Path) -> None:
        """Plots and report.json (only with `report`)."""

    def finish(self, run: JobRun, outcome: Outcome, t_save: float) -> dict:
        """Once saved: the manifest fields to rewrite (by default its `seconds`)."""
        outcome.seconds["save"] = time.perf_counter() - t_save
        return {"seconds": outcome.seconds}

    def publish(self, run: JobRun) -> None:
        """Rename the finished directory to `--out` (`OutputDir.publish`)."""
        run.output.publish(run.final)

    def result(self, outcome: Outcome, out: Path) -> dict:
        return dict(outcome.manifest, seconds=outcome.seconds, out=str(out))


def run_job(job: Job, model: str, out, options: RunOptions = RunOptions()) -> dict:
    """Run `job` on source `model` into `out` (see the module docstring); returns its result."""
    t_start = time.perf_counter()
    out = Path(out)
    job.check()
    may_exist = job.output_may_exist(options)
    check_output_free(out, may_exist, job.output_hint)
    source = SourceModel(model)
    inputs = {"the source model": source.path, **declared_inputs(getattr(job, "settings", None))}
    check_apart(output_paths(out), inputs)
    watch = InputWatch(inputs)  # before anything is read: a change from here on is seen
    job.validate(source, options)
    with OutputDir(out, job.kind, overwrite=options.overwrite, resume=options.resume,
                   resumable=job.resumable, out_may_exist=may_exist) as output, \
            reading(source.path) if Path(source.path).is_dir() else contextlib.nullcontext():
        settings, data = job.prepare(source)
        job.open(output, fingerprint(job.kind, settings, source.path, data))
        return _staged(job, JobRun(output, source, options, t_start, watch))


def _staged(job: Job, run: JobRun) -> dict:
    """The job once its output is locked and staged: work, save, rewrite the manifest, publish."""
    if run.main and job.fresh_final:
        shutil.rmtree(run.final, ignore_errors=True)
    distributed.barrier(f"{job.kind}:staging")
    try:
        outcome = job.work(run)
    except Interrupted as stop:
        return job.interrupted(stop.after)
    t_save = time.perf_counter()
    job.save(run, outcome)
    if job.report and run.main:
        job.write_report(outcome, run.final / "report")
    fields = job.finish(run, outcome, t_save) if job.manifest_name else None
    if run.main and fields:
        manifest = run.final / job.manifest_name
        write = write_sealed if job.manifest_name == MANIFEST else write_json_atomic
        write(manifest, dict(json.loads(manifest.read_text()), **fields))
    distributed.on_main(run.watch.check)  # what was read is still what the job started from
    job.publish(run)
    distributed.barrier(f"{job.kind}:published")
    return job.result(outcome, run.output.out)


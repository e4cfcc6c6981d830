"""A registered method run as a job: the method picked for the source (hierarchical CMoE
for an MoE source), its steps driven by the job skeleton."""
from __future__ import annotations

from pathlib import Path

from cmoe_jax.jobs.skeleton import Job, JobRun, Outcome, RunOptions, run_job
from cmoe_jax.methods import registry


class MethodJob(Job):
    """A conversion or compression method's steps (`cmoe_jax.methods.registry`) as a `Job`.
    The method is picked once the source is open (`registry.select`: hierarchical CMoE for
    an MoE source); its steps give `kind`, `resumable`, `validate`, `prepare`, `work`
    (returning `(model, manifest, seconds, records)`), `interrupted`, `write_report` and,
    optionally, `save` and `finish`; the settings may `check()` themselves."""

    def __init__(self, settings):
        self.settings, self.steps = settings, None
        self.report = bool(getattr(settings, "report", False))

    def check(self) -> None:
        if hasattr(self.settings, "check"):
            self.settings.check()

    def validate(self, source, options) -> None:
        self.steps = registry.select(self.settings, source.config).steps(self.settings)
        self.kind, self.resumable = self.steps.kind, self.steps.resumable
        self.steps.validate(source, options)

    def prepare(self, source):
        return self.steps.prepare(source)

    def work(self, run: JobRun) -> Outcome:
        model, manifest, seconds, records = self.steps.work(run)
        return Outcome(model, manifest, seconds, records)

    def interrupted(self, after: int) -> dict:
        return self.steps.interrupted(after)

    def save(self, run: JobRun, outcome: Outcome) -> None:
        if hasattr(self.steps, "save"):
            self.steps.save(run, outcome.model, outcome.manifest)
        else:
            super().save(run, outcome)

    def write_report(self, outcome: Outcome, directory: Path) -> None:
        self.steps.write_report(outcome.extra, outcome.manifest, outcome.seconds, directory)

    def finish(self, run: JobRun, outcome: Outcome, t_save: float) -> dict:
        if hasattr(self.steps, "finish"):
            return self.steps.finish(run, outcome.manifest, outcome.seconds)
        return super().finish(run, outcome, t_save)


def run_method(model: str, settings, *, out, resume: bool = False, overwrite: bool = False,
               progress: bool = True, stop_after_layers: int | None = None) -> dict:
    """Run the registered method that takes `settings` on `model` into `out`; returns the
    manifest with `out` (or, stopped by `stop_after_layers`, `{"out": None, ...}`)."""
    options = RunOptions(resume, overwrite, progress, stop_after=stop_after_layers)
    return run_job(MethodJob(settings), model, out, options)

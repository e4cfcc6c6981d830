"""Downcycling from Python: `downcycle(model, DowncycleSettings(...), out=...)`, the job
behind `python -m cmoe_jax.downcycle`, run by the job skeleton (`cmoe_jax.jobs.run_job`)."""
from __future__ import annotations

from cmoe_jax import distributed
from cmoe_jax.cli_args import check_writable_dir
from cmoe_jax.downcycle.job import DowncycleJob
from cmoe_jax.downcycle.settings import DowncycleSettings
from cmoe_jax.jobs import RunOptions, run_job


def downcycle(model: str, settings: DowncycleSettings, *, out, resume: bool = False, overwrite: bool = False,
              progress: bool = True) -> dict:
    """Weave dense `model` into an MoE with softmax routers as `settings` say and train all of
    it (ExpertWeaver's downcycling); returns the run's summary: the settings as recorded,
    `steps`, `first_nll`, `final_nll` and `out`.

    `out` then holds train_log.json (that summary and every step's record), loss.png and the
    Orbax checkpoints; `resume` continues an interrupted run from its latest checkpoint in
    `OUT.partial` (same source, text and settings). Bad settings raise a one-line `CmoeError`
    before anything is read or written. One process only (the run is not split).
    """
    distributed.require_single_process("python -m cmoe_jax.downcycle")
    job = DowncycleJob(settings)
    job.check()  # the settings, then the place of the output (the skeleton checks them again: cheap)
    check_writable_dir(str(out))
    return run_job(job, model, out, RunOptions(resume=resume, overwrite=overwrite, progress=progress))

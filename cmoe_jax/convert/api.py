"""The conversion job: settings checked first, then load, calibrate, convert, save, publish
(`cmoe_jax.jobs`); the method is the registered one that takes the settings and the source."""
from __future__ import annotations

from cmoe_jax.jobs import run_method


def convert(model: str, settings, *, out, resume: bool = False, overwrite: bool = False,
            progress: bool = True, stop_after_layers: int | None = None) -> dict:
    """Convert a dense checkpoint as `settings` say and save it at `out`; returns the manifest.

    `settings`: a `ConvertSettings` (CMoE) or a `WeaverSettings` (ExpertWeaver). An MoE `model`
    (a converted cmoe_jax MoE, Qwen3-MoE, Mixtral) given `ConvertSettings` is carved
    hierarchically: `settings.method.plan` is then the per-expert plan S'A'E'
    (`cmoe_jax.methods.hierarchical`), each expert profiled on the tokens its router sends
    it, or all tokens below `min_expert_tokens`. `settings.stream`: read, convert and write
    one decoder layer at a time (peak host memory about one layer); dense sources only.
    `settings.expert_parallel`: see `convert_model`; it changes where work runs, not the result.

    `stop_after_layers` exists for testing interruption: the job stops (as if killed) once
    that many layers are saved in the staging directory.
    """
    return run_method(model, settings, out=out, resume=resume, overwrite=overwrite, progress=progress,
                      stop_after_layers=stop_after_layers)

"""The compression job: arguments checked first, then load, calibrate, plan, save.

Like conversion, work happens in `<out>.partial/`: each MoE layer's calibration statistics
are saved there as it finishes (`--resume` continues from them), the finished model is
renamed to `<out>` at the end, so an interrupted run never leaves a half-written model.
The steps are `cmoe_jax.methods.conmoe`'s, run by the job skeleton (`cmoe_jax.jobs`).
"""
from __future__ import annotations

from cmoe_jax.jobs import run_method
from cmoe_jax.methods.conmoe import CompressSettings


def compress(model: str, settings: CompressSettings, *, out, resume: bool = False, overwrite: bool = False,
             progress: bool = True, stop_after_layers: int | None = None) -> dict:
    """Compress an MoE model's routed experts as `settings` say and save it at `out`; returns
    the manifest. `stop_after_layers` exists for testing interruption (the job stops once
    that many layers' statistics are saved)."""
    return run_method(model, settings, out=out, resume=resume, overwrite=overwrite, progress=progress,
                      stop_after_layers=stop_after_layers)

"""The fine-tuning job: check everything, load, train with checkpoints, merge, save.

Work happens in `OUT.partial/`; the finished run is renamed to `OUT`, which is then both a
converted model directory (`python -m cmoe_jax.eval --model OUT` loads the merged model)
and the record of the run:

    cmoe_manifest.json, state/, tokenizer/   merged model (same format as `cmoe_jax.convert`)
    adapters/                                LoRA A/B, u, b alone (Orbax) + adapter_config.json
    checkpoints/<step>/                      Orbax train state of the last steps (for --resume)
    run_config.json, train_log.json, loss.png

Over several processes (`cmoe_jax.distributed`) the run is data-parallel on one mesh over all
processes' devices: each process feeds the rows of every global batch that its devices hold,
the batch order is the single-process one, so is the trajectory (to float32 reduction
order). Process 0 alone prepares the directories and writes the JSON files, plot and
manifest; all processes write the Orbax checkpoints, adapters and merged state.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from cmoe_jax import distributed
from cmoe_jax.checkpoint import MANIFEST
from cmoe_jax.jobs import OutputDir, Staging, fingerprint
from cmoe_jax.train.checkpoint import RUN_CONFIG, check_run_config
from cmoe_jax.train.lora import TrainError
from cmoe_jax.train.loop import STOPPED
from cmoe_jax.train.modes import RECOVER_DIR
from cmoe_jax.train.run import FineTuning
from cmoe_jax.train.settings import TrainSettings


def _prepare_dirs(staging: Staging, fp: dict, settings: dict, resume: bool, overwrite: bool) -> bool:
    """Open the staging directory (process 0); True when the output must be replaced at the end."""
    out = staging.out
    if resume and staging.exists():
        staging.open(fp, resume=True)
        moved = staging.dir / "final" / "checkpoints"  # killed between this move and publish
        if moved.is_dir() and not (staging.dir / "checkpoints").exists():
            moved.rename(staging.dir / "checkpoints")
        return out.exists()
    if resume and (out / "checkpoints").exists():  # continue a finished (e.g. time-limited) run
        check_run_config(out, settings)
        staging.open(fp, resume=False, files={RUN_CONFIG: settings})
        for part in ("checkpoints", RECOVER_DIR) if (out / RECOVER_DIR).is_dir() else ("checkpoints",):
            copy = staging.dir / f".{part}.copy"
            shutil.copytree(out / part, copy)
            copy.rename(staging.dir / part)  # whole or not at all
        return True
    if out.exists() and not overwrite:
        raise TrainError(f"output directory {out} exists: pass --overwrite to replace it "
                         "(or --resume to continue its run)")
    if staging.exists() and not overwrite:
        raise TrainError(f"{staging.dir} holds an interrupted run: pass --resume to continue it "
                         "or --overwrite to start over")
    staging.open(fp, resume=False, files={RUN_CONFIG: settings})
    return out.exists()


def finetune(model: str, settings: TrainSettings = TrainSettings(), *, out, resume: bool = False,
             overwrite: bool = False, devices=None, progress: bool = True,
             stop_after_steps: int | None = None) -> dict:
    """LoRA fine-tuning of a dense or converted model (CMoE paper, section 4); returns a summary.

    `settings.mesh_shape = (data, model)` (default: all devices of all processes on "data");
    `settings.expert_parallel > 1` adds an "expert" axis of that many devices between them:
    the MoE layers' routed experts are split over it (tokens exchanged by all-to-all) and the
    batch over data x expert, so `batch_size` must be a multiple of data x expert.
    `stop_after_steps` exists for testing interruption: the job stops as if killed right after
    that step (its checkpoints stay in `OUT.partial`).
    """
    run = FineTuning(model, settings)  # everything that can be wrong, before any weight is loaded
    out = Path(out)
    with OutputDir(out, "train", overwrite=overwrite, resume=resume, out_may_exist=overwrite or resume,
                   resumable=("checkpoints/[0-9]*", "final/checkpoints/[0-9]*", RECOVER_DIR)) as output:
        run.read_data()
        run.build_mesh(devices)
        run_settings = run.run_settings()
        fp = fingerprint("train", run_settings, run.source.path, run.tokens)
        # process 0 alone touches the directories (the others wait for it)
        replace_out = output.on_main(lambda st: _prepare_dirs(st, fp, run_settings, resume, overwrite))
        progress = progress and output.main
        run.set_up(output.staging.dir, resume, progress)
        how = run.train(progress, stop_after_steps)
        if how == STOPPED:
            return {"out": None, "interrupted_after": run.log[-1]["step"], "log": run.log}
        summary = run.write_final(output.staging.dir, how, run_settings,
                                  _source_manifest(run.source.path, model))
        output.publish(output.staging.dir / "final", overwrite=replace_out or overwrite)
        distributed.barrier("train:published")
        return dict(summary, out=str(out))


def _source_manifest(path: Path, model: str) -> dict:
    """The source's conversion manifest (converted models) or a minimal one (dense models)."""
    if path.is_dir() and (path / MANIFEST).exists():
        manifest = json.loads((path / MANIFEST).read_text())
        for key in ("format", "model_config", "finetune"):
            manifest.pop(key, None)
        manifest["finetuned_from"] = str(model)
        return manifest
    return {"source_model": str(model), "method": "dense", "finetuned_from": str(model)}

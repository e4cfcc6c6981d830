"""The fine-tuning job: check everything, load, train with checkpoints, merge, save (the
steps of the job skeleton, `cmoe_jax.jobs.run_job`).

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

from cmoe_jax.checkpoint import MANIFEST
from cmoe_jax.errors import TrainError
from cmoe_jax.jobs import Interrupted, Job, JobRun, Outcome, OutputDir, RunOptions, Staging, run_job
from cmoe_jax.jobs.staging import check_continued_inputs
from cmoe_jax.train.run_checkpoints import RUN_CONFIG, check_run_config
from cmoe_jax.train.loop import STOPPED
from cmoe_jax.train.recovery import RECOVER_DIR
from cmoe_jax.train.run import FineTuning
from cmoe_jax.train.settings import TrainSettings


DATA_KEYS = ("dataset", "split", "data_path")  # what `--new-data` lets a continued run change
DATA_HISTORY = "data_history.json"  # staged beside run_config.json when the data changed


def _data_history(out: Path, saved: dict, recorded: dict, settings: dict, fp: dict) -> list | None:
    """The texts a continued run has trained on ({from_step, dataset, split, data_path,
    data_sha256} each), with the new one appended; None when the text is the same."""
    if recorded.get("data_sha256") == fp["data"]:
        return None
    log = json.loads((out / "train_log.json").read_text())
    history = log.get("data_history") or [
        {"from_step": 0, **{k: saved.get(k) for k in DATA_KEYS}, "data_sha256": recorded.get("data_sha256")}]
    return [*history, {"from_step": len(log["steps"]), **{k: settings.get(k) for k in DATA_KEYS},
                       "data_sha256": fp["data"]}]


def _prepare_dirs(staging: Staging, fp: dict, settings: dict, options: RunOptions, new_data: bool) -> bool:
    """Open the staging directory (process 0); True when the output must be replaced at the end."""
    out, resume, overwrite = staging.out, options.resume, options.overwrite
    if resume and staging.exists():
        staging.open(fp, resume=True)
        moved = staging.dir / "final" / "checkpoints"  # killed between this move and publish
        if moved.is_dir() and not (staging.dir / "checkpoints").exists():
            moved.rename(staging.dir / "checkpoints")
        return out.exists()
    if resume and (out / "checkpoints").exists():  # continue a finished (e.g. time-limited) run
        saved = check_run_config(out, settings, may_differ=DATA_KEYS if new_data else ())
        recorded = check_continued_inputs(out, fp, data_may_differ=new_data)
        history = _data_history(out, saved, recorded, settings, fp) if new_data else None
        staging.open(fp, resume=False, files={RUN_CONFIG: settings,
                                              **({DATA_HISTORY: history} if history else {})})
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


class TrainJob(Job):
    """A fine-tuning run as a job (`cmoe_jax.jobs.run_job`): its units of work are the steps,
    checkpointed in the staging directory; `--resume` may also continue a finished run in
    place (`_prepare_dirs`), whose output is then replaced on publish."""

    kind, fresh_final, manifest_name = "train", False, None  # `save` writes the manifest whole
    resumable = ("checkpoints/[0-9]*", "final/checkpoints/[0-9]*", RECOVER_DIR)

    def __init__(self, settings: TrainSettings, devices=None):
        self.settings, self.devices = settings, devices

    def output_may_exist(self, options: RunOptions) -> bool:
        return options.overwrite or options.resume

    def check(self) -> None:
        self.fine = FineTuning(self.settings)  # every check on the settings, before anything is read

    def validate(self, source, options: RunOptions) -> None:
        self.options = options
        self.fine.open(source)  # everything about the model, before any weight is loaded

    def prepare(self, source) -> tuple[dict, object]:
        self.fine.read_data()
        self.fine.build_mesh(self.devices)
        self.run_settings = self.fine.run_settings()
        return self.run_settings, self.fine.tokens

    def open(self, output: OutputDir, fingerprint: dict) -> None:
        # process 0 alone touches the directories (the others wait for it)
        self.replace_out = output.on_main(lambda staging: _prepare_dirs(
            staging, fingerprint, self.run_settings, self.options, self.settings.new_data))

    def work(self, run: JobRun) -> Outcome:
        progress = run.options.progress and run.main
        self.fine.set_up(run.output.staging.dir, run.options.resume, progress)
        how = self.fine.train(progress, run.options.stop_after)
        if how == STOPPED:
            raise Interrupted(self.fine.log[-1]["step"])
        return Outcome(None, _source_manifest(run.source.path, run.source.name), extra=how)

    def interrupted(self, after: int) -> dict:
        return {"out": None, "interrupted_after": after, "log": self.fine.log}

    def save(self, run: JobRun, outcome: Outcome) -> None:
        """The merged model, adapters, checkpoints, log and plot into `run.final`."""
        history = run.output.staging.dir / DATA_HISTORY  # the texts of a run continued on new data
        record = {**self.run_settings, **({"data_history": json.loads(history.read_text())}
                                          if history.is_file() else {})}
        self.summary = self.fine.write_final(run.output.staging.dir, outcome.extra, record, outcome.manifest)

    def publish(self, run: JobRun) -> None:
        run.output.publish(run.final, overwrite=self.replace_out or self.options.overwrite)

    def result(self, outcome: Outcome, out: Path) -> dict:
        return dict(self.summary, out=str(out))


def finetune(model: str, settings: TrainSettings = TrainSettings(), *, out, resume: bool = False,
             overwrite: bool = False, devices=None, progress: bool = True,
             stop_after_steps: int | None = None) -> dict:
    """LoRA fine-tuning of a dense or converted model (CMoE paper, section 4); returns a summary.

    `settings.mesh_shape = (data, model)` (default: all devices of all processes on "data");
    `settings.expert_parallel > 1` adds an "expert" axis of that many devices between them:
    the MoE layers' routed experts are split over it (tokens exchanged by all-to-all) and the
    batch over data x expert, so `batch_size` must be a multiple of data x expert.
    `stop_after_steps` exists for testing interruption: the job stops as if killed right after
    that step (its checkpoints stay in `OUT.partial`). `settings.new_data`: with `resume`,
    continue a finished run on another text (recorded in its log's `data_history`).
    """
    options = RunOptions(resume, overwrite, progress, stop_after=stop_after_steps)
    return run_job(TrainJob(settings, devices), model, out, options)


def _source_manifest(path: Path, model: str) -> dict:
    """The source's conversion manifest (converted models) or a minimal one (dense models)."""
    if path.is_dir() and (path / MANIFEST).exists():
        manifest = json.loads((path / MANIFEST).read_text())
        for key in ("format", "model_config", "finetune"):
            manifest.pop(key, None)
        manifest["finetuned_from"] = str(model)
        return manifest
    return {"source_model": str(model), "method": "dense", "finetuned_from": str(model)}

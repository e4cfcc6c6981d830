"""End-to-end ExpertWeaver job (`python -m cmoe_jax.convert --method expertweaver`): settings
checked first, then load, calibrate on tasks, weave, save; the same staging, resume, manifest
and atomic publish as the CMoE job."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from cmoe_jax.checkpoint import MANIFEST, save_converted, write_json_atomic
from cmoe_jax.methods.expertweaver import (
    WeaveConfig,
    arc_text,
    diverse_task_windows,
    task_windows,
    validate,
    weave_model,
    wikitext_articles,
)
from cmoe_jax.errors import CmoeError
from cmoe_jax.jobs import JobModel, LayerLog, OutputJob, check_output_free, fingerprint


MIXES = ("wikitext", "diverse")
DIVERSE_NEEDS_ARC = ("--calib-mix diverse needs --arc-path: ARC-Easy JSON lines (its questions make four of the "
                     "seven pseudo-task formats)")
DEFAULT_TASKS = {"wikitext": 32, "diverse": 42}


def calibration_tasks(tokenizer, data_path: str, arc_path: str | None, tasks: int,
                      samples_per_task: int, seqlen: int, mix: str = "wikitext", seed: int = 0):
    """(windows [N, seqlen], task ids [N], task names). `mix` "wikitext": WikiText-2 articles,
    then ARC-Easy as one task; "diverse": pseudo-tasks of seven formats (`task_mix.py`)."""
    if mix == "diverse":
        return diverse_task_windows(tokenizer, data_path, arc_path, tasks, samples_per_task, seqlen, seed)
    windows, ids = task_windows(wikitext_articles(data_path), tokenizer, samples_per_task, seqlen, tasks)
    names = [f"wikitext article {t}" for t in range(int(ids.max()) + 1)]
    if arc_path:
        arc_w, _ = task_windows([arc_text(arc_path)], tokenizer, samples_per_task, seqlen, 1)
        windows = np.concatenate([windows, arc_w])
        ids = np.concatenate([ids, np.full(len(arc_w), len(names), np.int32)])
        names.append("arc-easy")
    if len(names) < 2:
        raise CmoeError("ExpertWeaver needs at least 2 calibration tasks: raise --calib-tasks or add "
                        "--arc-path")
    return windows, ids, names


def layer_summary(records) -> dict:
    """Ranges over layers of alpha_l, r_l, N_se,l and the median CV (how much the rule adapted)."""
    def span(values):
        return {"min": min(values), "max": max(values), "mean": float(np.mean(values))}

    return {"alpha": span([r["alpha"] for r in records]), "r": span([r["r"] for r in records]),
            "n_shared": span([r["n_shared"] for r in records]),
            "cv_median": span([r["cv_quantiles"][1] for r in records if r.get("cv_quantiles")] or [0.0])}


def write_report(records, name: str, directory: Path, calibration: dict | None = None) -> None:
    """alpha_l and N_se,l over layers (the paper's Figure 7) as a PNG, plus report.json: per
    layer r_l, alpha_l, N_se,l and CV quantiles, their ranges, and the calibration tasks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    layers = np.arange(len(records))
    alpha = [r["alpha"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(layers, alpha, "o-", label="alpha_l (shared ratio)")
    ax.plot(layers, [r["r"] for r in records], "s--", label="r_l (share with CV > tau)")
    ax.set_xlabel("layer")
    ax.set_ylim(0, 1)
    ax2 = ax.twinx()
    ax2.bar(layers, [r["n_shared"] for r in records], alpha=0.2, color="tab:green")
    ax2.set_ylabel("N_se,l (shared experts)")
    ax.legend(fontsize=7, loc="upper center")
    mix = f", {calibration['mix']} calibration" if calibration and calibration.get("mix") else ""
    ax.set_title(f"ExpertWeaver {name}: layer-adaptive shared size{mix}", fontsize=9)
    fig.tight_layout()
    fig.savefig(directory / "alpha_per_layer.png", dpi=110)
    plt.close(fig)
    write_json_atomic(directory / "report.json", {
        "config": name, "calibration": calibration, "summary": layer_summary(records),
        "cv_quantile_levels": [0.1, 0.5, 0.9, 0.99], "layers": [
            {k: r.get(k) for k in ("r", "alpha", "n_shared", "kmeans_iterations", "cv_quantiles", "load",
                                   "seconds")}
            for r in records]})


def convert_expertweaver(model: str, cc: WeaveConfig, *, out, data_path: str | None = None,
                         arc_path: str | None = None, tasks: int | None = None, samples_per_task: int = 2,
                         seqlen: int = 256, calib_mix: str = "wikitext", resume: bool = False,
                         overwrite: bool = False,
                         report: bool = False, progress: bool = True,
                         stop_after_layers: int | None = None) -> dict:
    """Weave a dense checkpoint into an ExpertWeaver MoE saved at `out`; returns the manifest.
    `tasks` None: 32 WikiText articles (`calib_mix` "wikitext") or 42 pseudo-tasks ("diverse")."""
    t_start = time.perf_counter()
    out = Path(out)
    if calib_mix not in MIXES:
        raise CmoeError(f"--calib-mix {calib_mix!r} must be one of {', '.join(MIXES)}")
    if not data_path:
        raise CmoeError("--method expertweaver needs --data-path: the raw WikiText-2 validation file "
                        "(its articles are the calibration tasks)")
    if calib_mix == "diverse" and not arc_path:
        raise CmoeError(DIVERSE_NEEDS_ARC)
    tasks = DEFAULT_TASKS[calib_mix] if tasks is None else tasks
    check_output_free(out, overwrite)
    source = JobModel(model)
    cfg = source.config
    validate(cfg, cc)
    if seqlen > cfg.max_position_embeddings:
        raise CmoeError(f"--seqlen {seqlen} exceeds the model's context ({cfg.max_position_embeddings})")
    with OutputJob(out, "convert-expertweaver", overwrite=overwrite, resume=resume,
                   resumable=("layers/*.json",)) as job:
        tokenizer = source.require_tokenizer("calibration text cannot be tokenized")
        windows, task_ids, names = calibration_tasks(tokenizer, data_path, arc_path, tasks,
                                                     samples_per_task, seqlen, calib_mix, cc.seed)
        settings = {"model": str(model), **cc.to_dict(), "data_path": data_path,
                    "arc_path": arc_path, "tasks": tasks, "samples_per_task": samples_per_task,
                    "seqlen": seqlen}
        if calib_mix != "wikitext":  # the default keeps the fingerprint of earlier runs
            settings["calib_mix"] = calib_mix
        job.open(fingerprint("convert-expertweaver", settings, source.path, [windows, task_ids]))
        return _weave(job, source, cc, windows, task_ids, names, data_path=data_path,
                      arc_path=arc_path, calib_mix=calib_mix, samples_per_task=samples_per_task, seqlen=seqlen,
                      report=report, progress=progress, stop_after_layers=stop_after_layers,
                      t_start=t_start)


def _weave(job: OutputJob, source: JobModel, cc: WeaveConfig, windows, task_ids, names, *,
           data_path, arc_path, calib_mix, samples_per_task, seqlen, report, progress,
           stop_after_layers, t_start) -> dict:
    """The weaving once the output is locked and staged: weave layer by layer, save, publish."""
    model, cfg, out, staging = source.name, source.config, job.out, job.staging.dir
    layers = LayerLog(staging / "layers")
    done = layers.records(dict)
    lm = source.load(dtype=jnp.float32, progress=progress, stack=False)  # layers read in place
    t_conv = time.perf_counter()

    class _Stop(Exception):
        pass

    def on_layer(i, record):
        layers.save_json(i, record)
        if stop_after_layers is not None and i + 1 >= stop_after_layers:
            raise _Stop()

    try:
        moe_model, records = weave_model(lm.model, windows, task_ids, cc, progress=progress,
                                         done=done, on_layer=on_layer)
    except _Stop:
        return {"out": None, "config": cc.name, "interrupted_after": stop_after_layers}
    t_save = time.perf_counter()
    seconds = {"prepare_and_load": t_conv - t_start, "convert": t_save - t_conv,
               "profile": sum(r["seconds"]["profile"] for r in records),
               "cluster": sum(r["seconds"]["cluster"] for r in records)}
    manifest = {
        "source_model": str(model), **cc.to_dict(), "config": cc.name, "active_experts": cc.active,
        "expert_width": cfg.intermediate_size // cc.experts,
        "calibration": {"mix": calib_mix, "wikitext_path": data_path, "arc_path": arc_path, "tasks": names,
                        "samples_per_task": samples_per_task, "seqlen": seqlen},
        "layers": [{k: r[k] for k in ("alpha", "r", "n_shared", "shared", "experts",
                                      "kmeans_iterations", "cv_quantiles", "load")} for r in records],
    }
    final = staging / "final"
    shutil.rmtree(final, ignore_errors=True)
    save_converted(moe_model, manifest, final, tokenizer=lm.tokenizer)
    if report:
        write_report(records, cc.name, final / "report", manifest["calibration"])
    seconds["save"] = time.perf_counter() - t_save
    write_json_atomic(final / MANIFEST, dict(json.loads((final / MANIFEST).read_text()), seconds=seconds))
    job.publish(final)
    return dict(manifest, out=str(out), seconds=seconds)

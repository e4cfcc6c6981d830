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
import math
import shutil
import time
from pathlib import Path

import numpy as np

from cmoe_jax import distributed
from cmoe_jax.checkpoint import MANIFEST, save_converted
from cmoe_jax.errors import CmoeError
from cmoe_jax.jobs import SourceModel, OutputDir, Staging, fault_point, fingerprint
from cmoe_jax.train.checkpoint import RUN_CONFIG, check_run_config
from cmoe_jax.train.job import TrainJob
from cmoe_jax.train.lora import LoRAConfig, TrainError, parse_targets
from cmoe_jax.train.modes import RECOVER_DIR, RecoveryModes

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


def finetune(model: str, job: TrainJob = TrainJob(), *, out, resume: bool = False,
             overwrite: bool = False, devices=None, progress: bool = True,
             stop_after_steps: int | None = None) -> dict:
    """LoRA fine-tuning of a dense or converted model (CMoE paper, section 4); returns a summary.

    `job.mesh_shape = (data, model)` (default: all devices of all processes on "data");
    `job.expert_parallel > 1` adds
    an "expert" axis of that many devices between them: the MoE layers' routed experts are
    split over it (tokens exchanged by all-to-all) and the batch over data x expert, so
    `batch_size` must be a multiple of data x expert. `stop_after_steps` exists for testing
    interruption: the job stops as if killed right after that step (its checkpoints stay in
    `OUT.partial`).
    """
    dataset, data_path, split, samples = job.dataset, job.data_path, job.split, job.samples
    seqlen, batch_size, lora_rank, lora_alpha = job.seqlen, job.batch_size, job.lora_rank, job.lora_alpha
    dropout, targets, lr, router_lr = job.dropout, job.targets, job.lr, job.router_lr
    bias_speed, epochs, seed, save_every = job.bias_speed, job.epochs, job.seed, job.save_every
    max_steps, max_minutes, mesh_shape, expert_parallel = job.max_steps, job.max_minutes, job.mesh_shape, job.expert_parallel
    remat, dtype = job.remat, job.dtype
    modes = RecoveryModes.of(job)  # --distill / --recover checked before anything is read
    t_start = time.perf_counter()
    out = Path(out)
    targets = parse_targets(targets)
    lora = LoRAConfig(rank=lora_rank, alpha=float(lora_alpha), dropout=float(dropout), targets=targets)
    lora.validate()
    if samples < 1:
        raise TrainError(f"--samples must be at least 1, got {samples}")
    if seqlen < 2:
        raise TrainError(f"--seqlen must be at least 2, got {seqlen}")
    if save_every is not None and save_every < 1:
        raise TrainError(f"--save-every must be at least 1, got {save_every}")
    if max_steps is not None and max_steps < 0:
        raise TrainError(f"--max-steps must be non-negative, got {max_steps}")
    if dtype not in ("float32", "bfloat16"):
        raise TrainError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    for name, value in (("--lr", lr), ("--router-lr", router_lr), ("--bias-speed", bias_speed)):
        if not value >= 0:
            raise TrainError(f"{name} must be non-negative, got {value}")

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tqdm.auto import tqdm

    from cmoe_jax.data import load_text_tokens
    from cmoe_jax.models import Decoder
    from cmoe_jax.train.checkpoint import RunCheckpoints, save_adapters
    from cmoe_jax.train.data import BatchOrder, training_windows
    from cmoe_jax.train.lora import adapted_weights, merge_adapters
    from cmoe_jax.train.report import plot_loss, write_log
    from cmoe_jax.sharding import batch_axes, make_mesh
    from cmoe_jax.train.step import (OptimConfig, batch_sharding, init_state, make_train_step,
                                     split_frozen)

    # ---- everything that can be wrong is checked before any weight is loaded ---------------
    source = SourceModel(model)
    cfg, path = source.config, source.path
    if seqlen > cfg.max_position_embeddings:
        raise TrainError(f"--seqlen {seqlen} exceeds the model's context "
                         f"({cfg.max_position_embeddings} positions)")
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    adapted = adapted_weights(abstract, targets)  # targets that match nothing fail here
    tied = [i for i, s in enumerate(cfg.moe_layers) if s is not None and s.prototype_owner >= 0]
    if tied and any(p[1] in tied and p[3].startswith("expert_") for p, _ in adapted):
        raise TrainError("the model shares prototype tables across layers (compressed with "
                         "--scope > 1): per-layer adapters cannot be merged into a shared table; "
                         "compress with --scope 1, or leave the routed experts out of --targets")
    with OutputDir(out, "train", overwrite=overwrite, resume=resume, out_may_exist=overwrite or resume,
                   resumable=("checkpoints/[0-9]*", "final/checkpoints/[0-9]*", RECOVER_DIR)) as job:
        tokenizer = source.require_tokenizer("the training text cannot be tokenized")
        mode_settings = modes.open(source, tokenizer)  # the teacher fits the student, or one line
        tokens = load_text_tokens(dataset, tokenizer, split=split, data_path=data_path)
        windows = training_windows(tokens, samples, seqlen, seed,
                                   name=f"{dataset} ({data_path or split})")
        order = BatchOrder(samples, batch_size, epochs, seed)
        routed = {s.num_experts for s in cfg.moe_layers if s is not None}
        if expert_parallel > 1 and (not routed or any(n % expert_parallel for n in routed)):
            raise TrainError(f"--expert-parallel {expert_parallel} must divide the number of routed "
                             f"experts of every MoE layer ({sorted(routed) or 'the model has none'})")
        model_par = 1 if mesh_shape is None else mesh_shape[1]
        mesh = make_mesh(None if mesh_shape is None else mesh_shape[0], model_par,
                         expert=expert_parallel,
                         devices=jax.devices() if devices is None else devices)  # all processes
        data_par = math.prod(dict(mesh.shape)[a] for a in batch_axes(mesh))
        if batch_size % data_par:
            raise TrainError(f"--batch-size {batch_size} is not a multiple of the {data_par} devices "
                             "the batch is split over (data x expert axes of the mesh)")
        if expert_parallel > 1 and (batch_size * seqlen) % mesh.size:
            raise TrainError(f"--batch-size x --seqlen = {batch_size * seqlen} tokens must split over "
                             f"all {mesh.size} devices for the expert all-to-all")
        oc = OptimConfig(lr=lr, router_lr=router_lr, bias_speed=bias_speed)
        settings = {"model": str(model), "dataset": dataset, "split": split, "data_path": data_path,
                    "samples": samples, "seqlen": seqlen, "batch_size": batch_size,
                    "lora_rank": lora_rank, "lora_alpha": float(lora_alpha), "dropout": float(dropout),
                    "targets": list(targets), "lr": lr, "router_lr": router_lr,
                    "bias_speed": bias_speed, "epochs": epochs, "seed": seed, "dtype": dtype,
                    **mode_settings}
        fp = fingerprint("train", settings, path, tokens)
        # process 0 alone touches the directories (the others wait for it)
        replace_out = job.on_main(lambda st: _prepare_dirs(st, fp, settings, resume, overwrite))
        staging, main = job.staging.dir, job.main
        progress = progress and main

        # ---- load and set up ------------------------------------------------------------------
        lm = source.load(dtype=getattr(jnp, dtype), mesh=mesh, progress=progress)
        modes.load_teacher(getattr(jnp, dtype), mesh, progress)
        lm.model = modes.recover_model(lm.model, windows, lora, seed, staging, progress)
        state, shardings, tx = init_state(lm.model, lora, oc, jax.random.key(seed), mesh)
        graphdef, frozen, frozen_sh = split_frozen(lm.model, mesh)
        frozen, frozen_sh, objective = modes.objective(graphdef, frozen, frozen_sh, lora, remat, mesh)
        step_fn = make_train_step(graphdef, lora, oc, tx, shardings, frozen_sh, mesh, seed=seed,
                                  remat=remat, loss=objective)
        ckpts = RunCheckpoints(staging / "checkpoints")
        log: list[dict] = []
        start = 0
        latest = ckpts.latest_step() if resume else None
        if latest is not None:
            state, meta = ckpts.restore(latest, state, shardings)
            log, start = meta["log"], int(meta["position"]["step"])
        total = order.total_steps if max_steps is None else min(order.total_steps, max_steps)
        bsh = batch_sharding(mesh)

        def batch(step):  # each process builds only the rows its devices hold
            rows = windows[order.indices(step)]
            return jax.make_array_from_callback(rows.shape, bsh, lambda index: rows[index])

        t_compile = time.perf_counter()
        with jax.set_mesh(mesh):  # an "expert" axis makes the MoE layers run expert-parallel
            compiled = (step_fn.lower(state, frozen, batch(min(start, total - 1))).compile()
                        if total else None)
        compile_seconds = time.perf_counter() - t_compile

        def save(step):
            ckpts.save(step, state, {"position": order.position(step), "log": log})
            fault_point("checkpoint")

        # ---- train ----------------------------------------------------------------------------
        tokens_per_step = batch_size * seqlen
        last_dt, stopped_by_time = 0.0, False
        bar = tqdm(total=total, initial=start, desc="fine-tuning", disable=not progress)
        for step in range(start, total):
            if max_minutes is not None:  # process 0's clock decides for all
                over = time.perf_counter() - t_start + last_dt > max_minutes * 60
                if distributed.broadcast_from_main(over):
                    stopped_by_time = True
                    break
            t0 = time.perf_counter()
            state, loss, loads = compiled(state, frozen, batch(step))
            loss = float(loss)
            last_dt = time.perf_counter() - t0
            if not np.isfinite(loss):
                raise CmoeError(f"the loss became {loss} at step {step + 1}: lower --lr / --router-lr")
            log.append({"step": step + 1, "epoch": step // order.steps_per_epoch, "loss": loss,
                        "seconds": last_dt, "tokens_per_s": tokens_per_step / last_dt})
            bar.update(1)
            fault_point("step")
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_step / last_dt:,.0f}")
            if save_every and (step + 1) % save_every == 0:
                save(step + 1)
            if stop_after_steps is not None and step + 1 >= stop_after_steps:
                bar.close()
                ckpts.close()
                return {"out": None, "interrupted_after": step + 1, "log": log}
        bar.close()
        done = len(log)
        if ckpts.latest_step() != done:
            save(done)
        ckpts.close()

        # ---- merge and publish -----------------------------------------------------------------
        adapters, us, bs = distributed.to_host((state["trainable"]["lora"], state["trainable"]["u"],
                                                state["bias"]))
        merged = merge_adapters(lm.model, adapters, lora.scale, us, bs)
        train_seconds = sum(s["seconds"] for s in log)
        measured = log[start:] if len(log) > start else log
        summary = {
            **settings, "steps": done, "total_steps": order.total_steps, "resumed_from": start or None,
            "stopped_by_time": stopped_by_time, "adapted_weights": len(adapted),
            "trainable_parameters": int(sum(np.size(a) for a in jax.tree.leaves(
                {"lora": adapters, "u": us}))),
            "final_loss": log[-1]["loss"] if log else None,
            "first_loss": log[0]["loss"] if log else None,
            "tokens_per_s": (tokens_per_step * len(measured) / sum(s["seconds"] for s in measured)
                             if measured else None),
            "train_seconds": train_seconds, "compile_seconds": compile_seconds,
            "mesh": dict(mesh.shape), "platform": jax.devices()[0].platform,
            "wall_seconds": time.perf_counter() - t_start, **modes.memory,
            **({"recover_layers": modes.records} if modes.records else {}),
        }
        manifest = _source_manifest(path, model)
        manifest["finetune"] = {k: summary[k] for k in (*settings, "steps", "final_loss")}
        final = staging / "final"
        if main:
            shutil.rmtree(final, ignore_errors=True)
        distributed.barrier("train:final")
        save_converted(merged, manifest, final, tokenizer=lm.tokenizer)  # Orbax from all processes
        save_adapters(final / "adapters", adapters, us, bs,
                      {"source_model": str(model), "rank": lora_rank, "alpha": float(lora_alpha),
                       "scale": lora.scale, "dropout": float(dropout), "targets": list(targets),
                       "steps": done})
        if main:
            shutil.move(str(staging / "checkpoints"), str(final / "checkpoints"))
            if (staging / RECOVER_DIR).is_dir():
                shutil.move(str(staging / RECOVER_DIR), str(final / RECOVER_DIR))
            shutil.copy(staging / "run_config.json", final / "run_config.json")
            write_log(final / "train_log.json", summary, log)
            plot_loss(final / "loss.png", log, title=f"LoRA r={lora_rank} on {Path(str(model)).name}")
        job.publish(final, overwrite=replace_out or overwrite)
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

"""What a fine-tuning run records: the settings that decide its trajectory (run_config.json,
the resume fingerprint) and its summary (train_log.json without its steps, the command's
JSON)."""
from __future__ import annotations

import time

import numpy as np


def run_settings(run) -> dict:
    """The settings that decide the trajectory (run_config.json, the fingerprint)."""
    s, lora = run.settings, run.lora
    return {"model": str(run.name), "dataset": s.dataset, "split": s.split, "data_path": s.data_path,
            "samples": s.samples, "seqlen": s.seqlen, "batch_size": s.batch_size,
            "lora_rank": lora.rank, "lora_alpha": lora.alpha, "dropout": lora.dropout,
            "targets": list(lora.targets), "lr": s.optim.lr, "router_lr": s.optim.router_lr,
            "bias_speed": s.optim.bias_speed, "epochs": s.epochs, "seed": s.seed, "dtype": s.dtype,
            **run.mode_settings}


def run_summary(run, how: str, settings: dict) -> dict:
    """The run's record (train_log.json without its steps, the command's JSON)."""
    import jax

    from cmoe_jax.train.loop import OUT_OF_TIME

    log, start = run.log, run.start
    tokens_per_step = run.settings.batch_size * run.settings.seqlen
    measured = log[start:] if len(log) > start else log
    return {
        **settings, "steps": len(log), "total_steps": run.order.total_steps, "resumed_from": start or None,
        "stopped_by_time": how == OUT_OF_TIME, "adapted_weights": len(run.adapted),
        "trainable_parameters": int(sum(np.size(a) for a in jax.tree.leaves(
            {"lora": run.adapters[0], "u": run.adapters[1]}))),
        "final_loss": log[-1]["loss"] if log else None,
        "first_loss": log[0]["loss"] if log else None,
        "tokens_per_s": (tokens_per_step * len(measured) / sum(r["seconds"] for r in measured)
                         if measured else None),
        "train_seconds": sum(r["seconds"] for r in log), "compile_seconds": run.compile_seconds,
        "mesh": dict(run.mesh.shape), "platform": jax.devices()[0].platform,
        "wall_seconds": time.perf_counter() - run.t_start, **run.modes.memory,
        **({"recover_layers": run.modes.records} if run.modes.records else {}),
    }

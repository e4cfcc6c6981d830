"""Conversion report: activation-rate histograms and expert loads as PNG, a JSON summary."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from cmoe_jax.checkpoint import write_json_atomic


def summary(records, plan_name: str, stage_seconds: dict) -> dict:
    layers = []
    for i, r in enumerate(records):
        mu = np.asarray(r.mu, np.float64)
        load = np.asarray(r.load, np.int64)
        layers.append({
            "layer": i,
            "mu": {"mean": float(mu.mean()), "median": float(np.median(mu)), "max": float(mu.max()),
                   "p90": float(np.quantile(mu, 0.9)), "frac_zero": float((mu == 0).mean()),
                   "shared_mean": float(mu[np.asarray(r.carving.shared_idx)].mean())
                   if len(r.carving.shared_idx) else None},
            "load_per_expert": load.tolist(),
            "load_cv": float(load.std() / load.mean()) if load.size and load.mean() > 0 else None,
            "kmeans_iterations": int(r.carving.iterations),
            "seconds": r.seconds,
        })
    return {"config": plan_name, "stage_seconds": stage_seconds, "layers": layers}


def _grid(n):
    cols = min(6, n)
    return cols, math.ceil(n / cols)


def plot_activation_rates(records, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols, rows = _grid(len(records))
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.0 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= len(records):
            ax.axis("off")
            continue
        mu = np.asarray(records[i].mu)
        ax.hist(mu, bins=50, color="tab:blue", log=True)
        shared = np.asarray(records[i].carving.shared_idx)
        if shared.size:
            ax.axvline(mu[shared].min(), color="tab:red", lw=1, label="shared cut")
        ax.set_title(f"layer {i}", fontsize=8)
        ax.tick_params(labelsize=6)
    fig.suptitle("Activation rate μ per neuron (ATopK markers), log count")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_expert_load(records, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    load = np.stack([np.asarray(r.load, np.float64) for r in records])
    frac = load / np.maximum(load.sum(axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(max(4, 0.5 * load.shape[1] + 2), max(3, 0.22 * len(records) + 1)))
    im = ax.imshow(frac, aspect="auto", cmap="viridis")
    ax.set_xlabel("routed expert")
    ax.set_ylabel("layer")
    ax.set_title("Share of routed tokens per expert (calibration)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(records, plan_name: str, stage_seconds: dict, directory: Path) -> dict:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    s = summary(records, plan_name, stage_seconds)
    plot_activation_rates(records, directory / "activation_rates.png")
    plot_expert_load(records, directory / "expert_load.png")
    write_json_atomic(directory / "report.json", s)
    return s

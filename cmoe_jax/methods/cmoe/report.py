"""Conversion report: activation-rate histograms, expert loads and each layer's shape and
error as PNG, a JSON summary, and the short per-layer table the command prints."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from cmoe_jax.atomic_files import write_json_atomic
from cmoe_jax.errors import optional


def _mu_stats(r) -> dict | None:
    mu = np.asarray(r.mu, np.float64)
    if not mu.size:  # a kept dense layer is not profiled
        return None
    return {"mean": float(mu.mean()), "median": float(np.median(mu)), "max": float(mu.max()),
            "p90": float(np.quantile(mu, 0.9)), "frac_zero": float((mu == 0).mean()),
            "shared_mean": float(mu[np.asarray(r.carving.shared_idx)].mean())
            if len(r.carving.shared_idx) else None}


def summary(records, plan_name: str, stage_seconds: dict, shapes=None) -> dict:
    """`shapes`: each layer's (shape name, active share), e.g. from `layer_shapes`."""
    layers = []
    for i, r in enumerate(records):
        load = np.asarray(r.load, np.int64)
        shape = {} if shapes is None else {"shape": shapes[i][0], "active_share": shapes[i][1]}
        layers.append({
            "layer": i, **shape, "error": r.error,
            "mu": _mu_stats(r),
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
    plt = optional("matplotlib.pyplot", "plots", "PNG plots")
    if plt is None:
        return
    plt.switch_backend("Agg")

    cols, rows = _grid(len(records))
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.0 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= len(records):
            ax.axis("off")
            continue
        mu = np.asarray(records[i].mu)
        if not mu.size:
            ax.set_title(f"layer {i} (dense)", fontsize=8)
            ax.axis("off")
            continue
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
    plt = optional("matplotlib.pyplot", "plots", "PNG plots")
    if plt is None:
        return
    plt.switch_backend("Agg")

    width = max(1, max(len(r.load) for r in records))
    load = np.full((len(records), width), np.nan)
    for i, r in enumerate(records):  # layers of fewer experts (or dense) leave blanks
        load[i, :len(r.load)] = r.load
    frac = load / np.maximum(np.nansum(load, axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(max(4, 0.5 * load.shape[1] + 2), max(3, 0.22 * len(records) + 1)))
    im = ax.imshow(frac, aspect="auto", cmap="viridis")
    ax.set_xlabel("routed expert")
    ax.set_ylabel("layer")
    ax.set_title("Share of routed tokens per expert (calibration)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_layers(records, shapes, path: Path) -> None:
    """Each layer's active share (bars, left axis) and stream error (line, log, right axis)."""
    plt = optional("matplotlib.pyplot", "plots", "PNG plots")
    if plt is None:
        return
    plt.switch_backend("Agg")

    n = len(records)
    fig, ax = plt.subplots(figsize=(max(5, 0.28 * n + 2), 3.2))
    ax.bar(range(n), [share for _, share in shapes], color="tab:blue", alpha=0.6, label="active share")
    ax.set_xlabel("layer")
    ax.set_ylabel("active share of FFN neurons")
    ax.set_ylim(0, 1.05)
    errors = [np.nan if not r.error else r.error for r in records]
    if not np.all(np.isnan(errors)):
        twin = ax.twinx()
        twin.plot(range(n), errors, "o-", color="tab:red", ms=3, label="stream error")
        twin.set_yscale("log")
        twin.set_ylabel("relative stream error", color="tab:red")
    ax.set_title("Shape and error per layer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def layer_table(layers: list[dict]) -> str:
    """The per-layer table a conversion prints: layer, shape, active share, stream error."""
    rows = ["layer  shape       active  error"]
    for entry in layers:
        error = entry.get("error")
        rows.append(f"{entry['layer']:>5}  {entry['shape']:<10}  {entry['active_share']:>6.3f}  "
                    + ("-" if error is None else f"{error:.2e}"))
    return "\n".join(rows)


def band_table(budget: dict) -> str:
    """`--spread auto`'s lines: each band tried, its held-out loss, the one chosen."""
    rows = ["band  held-out nll"]
    for trial in budget["band_trials"]:
        nll = trial["held_out_nll"]
        rows.append(f"{trial['spread']:>4}  " + ("no allocation" if nll is None else f"{nll:.5f}")
                    + ("  chosen" if trial["spread"] == budget["spread_chosen"] else ""))
    return "\n".join(rows)


def write_report(records, plan_name: str, stage_seconds: dict, directory: Path, shapes=None) -> dict:
    """report.json, activation_rates.png, expert_load.png and (with `shapes`) layers.png."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    s = summary(records, plan_name, stage_seconds, shapes)
    plot_activation_rates(records, directory / "activation_rates.png")
    plot_expert_load(records, directory / "expert_load.png")
    if shapes is not None:
        plot_layers(records, shapes, directory / "layers.png")
    write_json_atomic(directory / "report.json", s)
    return s

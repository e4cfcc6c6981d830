"""ExpertWeaver's report: alpha_l and N_se,l over layers (the paper's Figure 7) as a PNG, and
report.json with each layer's figures and their ranges."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from cmoe_jax.atomic_files import write_json_atomic
from cmoe_jax.errors import optional


def layer_summary(records) -> dict:
    """Ranges over layers of alpha_l, r_l, N_se,l and the median CV (how much the rule adapted)."""
    def span(values):
        return {"min": min(values), "max": max(values), "mean": float(np.mean(values))}

    return {"alpha": span([r["alpha"] for r in records]), "r": span([r["r"] for r in records]),
            "n_shared": span([r["n_shared"] for r in records]),
            "cv_median": span([r["cv_quantiles"][1] for r in records if r.get("cv_quantiles")] or [0.0])}


def plot_alpha(records, name: str, path: Path, mix: str | None) -> None:
    plt = optional("matplotlib.pyplot", "plots", "PNG plots")
    if plt is None:
        return
    plt.switch_backend("Agg")

    layers = np.arange(len(records))
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(layers, [r["alpha"] for r in records], "o-", label="alpha_l (shared ratio)")
    ax.plot(layers, [r["r"] for r in records], "s--", label="r_l (share with CV > tau)")
    ax.set_xlabel("layer")
    ax.set_ylim(0, 1)
    ax2 = ax.twinx()
    ax2.bar(layers, [r["n_shared"] for r in records], alpha=0.2, color="tab:green")
    ax2.set_ylabel("N_se,l (shared experts)")
    ax.legend(fontsize=7, loc="upper center")
    mix = f", {mix} calibration" if mix else ""
    ax.set_title(f"ExpertWeaver {name}: layer-adaptive shared size{mix}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(records, name: str, directory: Path, calibration: dict | None = None) -> None:
    """The PNG plus report.json: per layer r_l, alpha_l, N_se,l and CV quantiles, their
    ranges, and the calibration tasks."""
    directory.mkdir(parents=True, exist_ok=True)
    plot_alpha(records, name, directory / "alpha_per_layer.png", (calibration or {}).get("mix"))
    write_json_atomic(directory / "report.json", {
        "config": name, "calibration": calibration, "summary": layer_summary(records),
        "cv_quantile_levels": [0.1, 0.5, 0.9, 0.99], "layers": [
            {k: r.get(k) for k in ("r", "alpha", "n_shared", "kmeans_iterations", "cv_quantiles", "load",
                                   "seconds")}
            for r in records]})

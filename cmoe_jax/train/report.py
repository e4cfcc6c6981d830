"""Training outputs for people: the JSON log and the loss-curve PNG (with the `plots` extra)."""
from __future__ import annotations

from pathlib import Path

from cmoe_jax.atomic_files import write_json_atomic
from cmoe_jax.errors import optional


def write_log(path: Path, summary: dict, steps: list[dict]) -> None:
    write_json_atomic(Path(path), dict(summary, steps=steps))


def plot_loss(path: Path, steps: list[dict], title: str = "") -> None:
    plt = optional("matplotlib.pyplot", "plots", "the loss plot")
    if plt is None:
        return
    plt.switch_backend("Agg")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = [s["step"] for s in steps]
    ys = [s["loss"] for s in steps]
    ax.plot(xs, ys, lw=0.8, label="loss")
    if len(ys) >= 10:  # running mean over ~5% of the run
        w = max(2, len(ys) // 20)
        smooth = [sum(ys[max(0, i - w + 1):i + 1]) / len(ys[max(0, i - w + 1):i + 1]) for i in range(len(ys))]
        ax.plot(xs, smooth, lw=1.5, label=f"mean of {w}")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("next-token NLL")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = Path(path).with_name(Path(path).name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)

"""Draw docs/architecture.png: the data flow through the package, one box per stage, each
labelled with the folder that holds it.  python scripts/architecture_figure.py"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "architecture.png"

# (x, y, title, where): the main line of the data flow, left to right then down
STAGES = [
    (0.0, 2.0, "checkpoint", "HF safetensors / .bin,\nGGUF, converted dir"),
    (1.0, 2.0, "load", "loading/\n-> models/ Decoder"),
    (2.0, 2.0, "layer pass", "profiling/layer_pass.py\n(written once)"),
    (3.0, 2.0, "method", "methods/cmoe, hierarchical,\nexpertweaver, conmoe"),
    (3.0, 1.0, "MoE modules", "moe/ MoEFFN, HierMoEFFN\nmodels/ffn.py filled_ffn"),
    (2.0, 1.0, "save", "checkpoint.py\n(staged, published whole)"),
    (1.0, 1.0, "eval / train / export", "eval/  train/  export/"),
]
SIDE = [
    (3.0, 3.0, "shared algorithms", "carving/ (assignment,\nbalanced K-means)"),
    (2.0, 3.0, "data", "data/ (WikiText-2, C4,\nlocal files)"),
    (0.0, 1.0, "jobs and CLIs", "jobs/ (lock, staging, resume)\nconvert/ compress/ train/ ...\ncmoe-jax (commands.py)"),
]


def box(ax, x, y, title, where, color):
    ax.add_patch(FancyBboxPatch((x - 0.42, y - 0.3), 0.84, 0.6, boxstyle="round,pad=0.02",
                                fc=color, ec="#333333", lw=1.2))
    ax.text(x, y + 0.12, title, ha="center", va="center", fontsize=11, weight="bold")
    ax.text(x, y - 0.1, where, ha="center", va="center", fontsize=8, family="monospace")


def arrow(ax, a, b, style="-|>", dashed=False):
    (x0, y0), (x1, y1) = a, b
    dx, dy = x1 - x0, y1 - y0
    sx = 0.44 if dx else 0.0
    sy = 0.32 if dy else 0.0
    ax.add_patch(FancyArrowPatch((x0 + sx * (dx > 0) - sx * (dx < 0), y0 + sy * (dy > 0) - sy * (dy < 0)),
                                 (x1 - sx * (dx > 0) + sx * (dx < 0), y1 - sy * (dy > 0) + sy * (dy < 0)),
                                 arrowstyle=style, mutation_scale=14, lw=1.3,
                                 ls="--" if dashed else "-", color="#333333"))


def main() -> None:
    fig, ax = plt.subplots(figsize=(12, 6.2))
    for x, y, title, where in STAGES:
        box(ax, x, y, title, where, "#dbe9f6")
    for x, y, title, where in SIDE:
        box(ax, x, y, title, where, "#f3f3f3")
    main_line = [(s[0], s[1]) for s in STAGES]
    for a, b in zip(main_line, main_line[1:]):
        arrow(ax, a, b)
    arrow(ax, (3.0, 3.0), (3.0, 2.0), dashed=True)   # algorithms -> method
    arrow(ax, (2.0, 3.0), (2.0, 2.0), dashed=True)   # calibration data -> layer pass
    arrow(ax, (0.0, 1.0), (0.0, 2.0), dashed=True)   # a job drives the line
    ax.text(1.5, 0.35, "Imports flow one way: errors, lora < moe, sharding, distributed < models, data < "
            "checkpoint, profiling, carving < loading < methods < jobs < convert, compress, train, "
            "eval, export < cmoe-jax", ha="center", fontsize=8.5, style="italic")
    ax.set_xlim(-0.6, 3.6)
    ax.set_ylim(0.2, 3.45)
    ax.axis("off")
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

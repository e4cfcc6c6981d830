"""Draw the architecture pictures from the code itself.

    python scripts/architecture_figure.py

- docs/architecture.png: the package's layers as `tests/test_structure.py` defines them (lowest
  at the bottom), one box per part, and every import between parts read from the source;
- docs/architecture-flow.png: the data flow of a conversion job;
- docs/architecture.json: the layers and import edges the first picture shows, which the
  structure test compares with the code (it fails when the picture is out of date).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(ROOT / "tests"))
from test_structure import LAYERS, import_graph  # noqa: E402

# what each part is for, in a few words (a part missing here is drawn with its name only)
ROLE = {
    "errors": "one-line errors", "lora_variables": "LoRA variables\n(per module)", "faults": "fault hook",
    "moe": "MoE layers, routers,\ngrouped matmuls", "sharding": "meshes", "distributed": "multi-host",
    "cli_args": "shared flags", "models": "decoder, families", "data": "corpora, windows",
    "checkpoint": "converted format", "calibration_pass": "markers, layer pass",
    "carving": "assignment, K-means", "loading": "checkpoints in", "methods": "cmoe, hierarchical,\nexpertweaver, conmoe",
    "jobs": "lock, staging,\nresume, publish", "convert": "job + CLI", "compress": "job + CLI",
    "train": "job + CLI (LoRA);\ntrain state, step loop", "eval": "job + CLI", "export": "job + CLI", "demo": "README table",
    "__init__": "public API", "downcycle": "job + CLI", "generate": "KV-cache decoding\n+ CLI",
    "commands": "cmoe-jax", "atomic_files": "whole-file writes", "orbax_io": "Orbax errors\nas one line",
    "state_digests": "saved arrays'\nchecksums",
}


def picture_data() -> dict:
    """The layers and cross-part import edges as plain JSON (what the picture shows)."""
    graph = import_graph()
    return {"layers": [sorted(layer) for layer in LAYERS],
            "edges": sorted([src, dst] for src, dsts in graph.items() for dst in dsts)}


def box(ax, x, y, title, note, color, w=0.86, h=0.56):
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02",
                                fc=color, ec="#333333", lw=1.0, zorder=2))
    ax.text(x, y + (0.1 if note else 0), title, ha="center", va="center",
            fontsize=9.5 if len(title) <= 13 else 8.2, weight="bold", zorder=3)  # long names fit the box
    if note:
        ax.text(x, y - 0.12, note, ha="center", va="center", fontsize=6.8, zorder=3)


def draw_layers(data: dict, out: Path) -> None:
    layers = data["layers"]
    width = max(len(layer) for layer in layers)
    fig, ax = plt.subplots(figsize=(1.25 * width + 2.5, 0.9 * len(layers) + 0.8))
    where = {}
    for level, layer in enumerate(layers):
        for i, part in enumerate(layer):
            where[part] = (i - (len(layer) - 1) / 2, float(level))
        ax.text(-width / 2 - 0.35, level, f"layer {level}", ha="right", va="center", fontsize=8,
                color="#555555")
    for src, dst in data["edges"]:
        (x0, y0), (x1, y1) = where[src], where[dst]
        ax.add_patch(FancyArrowPatch((x0, y0 - 0.28), (x1, y1 + 0.28), arrowstyle="-|>",
                                     mutation_scale=7, lw=0.5, color="#7a8ca0", alpha=0.55, zorder=1))
    top = len(layers) - 3  # the jobs with their command lines (downcycle on train's), and the entry points
    for part, (x, y) in where.items():
        color = "#e3f1dc" if y >= top else "#dbe9f6" if part in ("moe", "models", "methods", "jobs") else "#f3f3f3"
        box(ax, x, y, part if part != "__init__" else "cmoe_jax", ROLE.get(part, ""), color)
    ax.set_title("cmoe_jax: a part imports only parts of lower layers (arrows: imports, read from "
                 "the source)", fontsize=10)
    ax.set_xlim(-width / 2 - 1.4, width / 2 + 0.2)
    ax.set_ylim(-0.6, len(layers) - 0.4)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# (x, y, title, folder): a conversion job's data flow, left to right then down
FLOW = [
    (0.0, 1.0, "checkpoint in", "loading/ (safetensors,\n.bin, GGUF, converted)"),
    (1.0, 1.0, "decoder", "models/ Decoder"),
    (2.0, 1.0, "layer pass", "calibration_pass/\nlayer_pass.py\n+ data/ calibration windows"),
    (3.0, 1.0, "method step", "methods/<method>/\n(uses carving/, moe/)"),
    (3.0, 0.0, "converted layers", "checkpoint/ format,\nstaged by jobs/"),
    (2.0, 0.0, "published model", "OUT/ (manifest, state,\ntokenizer)"),
    (1.0, 0.0, "eval / train / export", "eval/  train/  export/\ngenerate"),
]


def draw_flow(out: Path) -> None:
    fig, ax = plt.subplots(figsize=(11, 3.6))
    for x, y, title, note in FLOW:
        box(ax, x, y, title, note, "#dbe9f6", w=0.84, h=0.6)
    for (x0, y0, *_), (x1, y1, *_) in zip(FLOW, FLOW[1:]):
        dx, dy = x1 - x0, y1 - y0
        start = (x0 + 0.43 * dx, y0 + 0.31 * dy)
        end = (x1 - 0.43 * dx, y1 - 0.31 * dy)
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14, lw=1.2,
                                     color="#333333"))
    ax.set_title("data flow of a conversion job (one decoder layer at a time)", fontsize=10)
    ax.set_xlim(-0.5, 3.5)
    ax.set_ylim(-0.45, 1.45)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    data = picture_data()
    draw_layers(data, DOCS / "architecture.png")
    draw_flow(DOCS / "architecture-flow.png")
    (DOCS / "architecture.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {DOCS / 'architecture.png'}, {DOCS / 'architecture-flow.png'}, {DOCS / 'architecture.json'}")


if __name__ == "__main__":
    main()

"""Draw the architecture pictures from the code itself.

    python scripts/architecture_figure.py

- docs/architecture.png: the package's tiers as `tests/test_structure.py` defines them
  (entry points, jobs, methods, models and moe, foundations, kernels; lowest at the bottom),
  one box per part, and one arrow per pair of tiers that import each other, labelled with
  the number of part-to-part imports read from the source (not every edge: readable);
- docs/architecture-flow.png: the data flow of a conversion job;
- docs/architecture.json: the tiers, the imports between them and the finer layers, which
  the structure test compares with the code (it fails when the picture is out of date).
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
from test_structure import LAYERS, TIERS, tier_edges  # noqa: E402

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
    "commands": "cmoe-jax", "atomic_files": "whole-file writes", "host_arrays": "aligned host\nbuffers", "orbax_io": "Orbax errors\nas one line",
    "state_digests": "saved arrays'\nchecksums", "moe.gmm": "grouped matmuls: CPU,\nragged_dot, Pallas GPU,\nmegablox TPU, tokamax",
}
# what each tier is for (the left column of the picture)
TIER_ROLE = {
    "entry points": "cmoe-jax, the public API,\nthe README demo",
    "jobs": "one skeleton: check, stage,\nunits of work, resume, publish",
    "methods": "CMoE, hierarchical, ExpertWeaver,\nConMoE; KV-cache decoding",
    "models and moe": "decoder of every family, MoE layers\nand routers, the layer pass,\ncheckpoints in and out",
    "foundations": "errors, meshes, flags,\nwhole-file writes, checksums",
    "kernels": "one grouped matmul per platform,\nimporting nothing of the project",
}


def picture_data() -> dict:
    """The tiers, the imports between them and the finer layers as plain JSON."""
    return {"tiers": [[name, sorted(parts)] for name, parts in TIERS], "tier_edges": tier_edges(),
            "layers": [sorted(layer) for layer in LAYERS]}


def box(ax, x, y, title, note, color, w=0.86, h=0.56):
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02",
                                fc=color, ec="#333333", lw=1.0, zorder=2))
    ax.text(x, y + (0.1 if note else 0), title, ha="center", va="center",
            fontsize=9.5 if len(title) <= 11 else 7.8, weight="bold", zorder=3)  # long names fit the box
    if note:
        ax.text(x, y - 0.12, note, ha="center", va="center", fontsize=6.2, zorder=3)


TIER_COLOR = {"entry points": "#e3f1dc", "jobs": "#e3f1dc", "methods": "#dbe9f6",
              "models and moe": "#dbe9f6", "foundations": "#f3f3f3", "kernels": "#fbe8d3"}
STEP, BAND = 1.35, 1.0  # tier spacing and band height


def draw_layers(data: dict, out: Path) -> None:
    tiers = data["tiers"]
    width = max(len(parts) for _, parts in tiers)
    right = width * 0.58 + 0.1
    fig, ax = plt.subplots(figsize=(1.16 * width + 6.5, STEP * len(tiers) + 0.9))
    index = {name: i for i, (name, _) in enumerate(tiers)}
    for level, (name, parts) in enumerate(tiers):
        y = level * STEP
        ax.add_patch(FancyBboxPatch((-right, y - BAND / 2), 2 * right, BAND, boxstyle="round,pad=0.03",
                                    fc="#fafafa", ec="#999999", lw=0.8, zorder=0))
        ax.text(-right - 0.25, y + 0.18, name, ha="right", va="center", fontsize=10, weight="bold")
        ax.text(-right - 0.25, y - 0.2, TIER_ROLE.get(name, ""), ha="right", va="center", fontsize=7,
                color="#444444")
        for i, part in enumerate(parts):
            x = (i - (len(parts) - 1) / 2) * 1.16
            title = {"__init__": "cmoe_jax", "moe.gmm": "moe/gmm"}.get(part, part)
            box(ax, x, y, title, ROLE.get(part, ""), TIER_COLOR.get(name, "#f3f3f3"), w=1.1, h=0.7)
    # one arrow per pair of tiers, to the right of the bands; the label counts the imports
    for k, (src, dst, n) in enumerate(sorted(data["tier_edges"], key=lambda e: (-index[e[0]], -index[e[1]]))):
        x = right + 0.3 + 0.3 * k
        y0, y1 = index[src] * STEP - BAND / 2 + 0.05, index[dst] * STEP + BAND / 2 - 0.05
        ax.add_patch(FancyArrowPatch((x, y0), (x, y1), arrowstyle="-|>", mutation_scale=10,
                                     lw=0.6 + n / 8, color="#5a7089", zorder=1))
        ax.text(x + 0.05, (y0 + y1) / 2, str(n), ha="left", va="center", fontsize=7, color="#33475b",
                bbox=dict(fc="white", ec="none", pad=0.5))
    ax.set_title("cmoe_jax in tiers: a part imports only its own tier or lower ones (each arrow: the "
                 "number of imports between two tiers, read from the source)", fontsize=9.5)
    ax.set_xlim(-right - 3.2, right + 0.5 + 0.3 * len(data["tier_edges"]))
    ax.set_ylim(-0.7, (len(tiers) - 1) * STEP + 0.7)
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

"""Compression report: the slot map across layers and the score distributions as PNG."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from cmoe_jax.atomic_files import write_json_atomic
from cmoe_jax.errors import optional


def slot_matrix(plans, num_experts: int):
    """`[layers, E]` source layer of each slot's prototype (-1 pruned, nan merged or, past a
    layer's own slots when layers differ in expert count, no slot); E the most slots."""
    rows = []
    for plan in plans:
        for l in plan.layers:
            src = np.full(num_experts, np.nan)
            for e, p in enumerate(plan.slot_maps[l]):
                if p < 0:
                    src[e] = -1
                elif np.count_nonzero(plan.mix[p]) == 1:
                    src[e] = plan.unit_layer(int(np.argmax(plan.mix[p])))
            rows.append(src)
    return np.stack(rows) if rows else np.zeros((0, num_experts))


def plot_slot_map(plans, num_experts: int, path: Path) -> None:
    plt = optional("matplotlib.pyplot", "plots", "PNG plots")
    if plt is None:
        return
    plt.switch_backend("Agg")

    src = slot_matrix(plans, num_experts)
    layers = [l for p in plans for l in p.layers]
    fig, ax = plt.subplots(figsize=(max(4, 0.6 * num_experts + 2), max(3, 0.22 * len(layers) + 1)))
    im = ax.imshow(src, aspect="auto", cmap="viridis", interpolation="nearest")
    for r, l in enumerate(layers):
        for e, p in enumerate(plans_row(plans, l)):
            ax.text(e, r, "x" if p < 0 else str(p), ha="center", va="center", fontsize=5, color="w")
    ax.set_xlabel("router slot")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(len(layers)), [str(l) for l in layers], fontsize=5)
    ax.set_title("Layer of each slot's prototype (text: table row; x pruned)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plans_row(plans, layer):
    return next(p.slot_maps[layer] for p in plans if layer in p.slot_maps)


def plot_scores(plans, stats, path: Path) -> None:
    plt = optional("matplotlib.pyplot", "plots", "PNG plots")
    if plt is None:
        return
    plt.switch_backend("Agg")

    panels = {"contribution a_e": np.concatenate([s.contrib for s in stats.values()]),
              "usage (tokens)": np.concatenate([s.freq for s in stats.values()]).astype(float)}
    for key, title in (("b", "replaceability b_e"), ("score", "score s_e")):
        vals = [v for p in plans for v in p.info.get(key, [])]
        if vals:
            panels[title] = np.asarray(vals)
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 2.8), squeeze=False)
    for ax, (title, v) in zip(axes[0], panels.items()):
        ax.hist(v, bins=40, color="tab:blue")
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
    fig.suptitle("Expert score distributions (all MoE layers)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(plans, stats, compression: dict, directory: Path) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    num_experts = max(len(s.freq) for s in stats.values())
    if plans:
        plot_slot_map(plans, num_experts, directory / "slot_map.png")
    plot_scores(plans, stats, directory / "scores.png")
    write_json_atomic(directory / "report.json", {"compression": compression,
                                                  "slot_maps": {str(l): plans_row(plans, l).tolist()
                                                                for p in plans for l in p.layers}})

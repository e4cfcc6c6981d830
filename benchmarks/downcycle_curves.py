"""One PNG of the next-token loss of several downcycling runs (`python -m
cmoe_jax.downcycle`), e.g. ExpertWeaver vs random neuron split vs random initialisation.

    python benchmarks/downcycle_curves.py RUN_DIR... --out curves.png [--smooth 10]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--smooth", type=int, default=10, help="running-mean window (steps)")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for run in args.runs:
        log = json.loads((Path(run) / "train_log.json").read_text())
        nll = np.array([s["nll"] for s in log["steps"]])
        w = max(1, min(args.smooth, len(nll)))
        smooth = np.convolve(nll, np.ones(w) / w, mode="valid")
        line, = ax.plot(np.arange(1, len(nll) + 1), nll, lw=0.5, alpha=0.35)
        ax.plot(np.arange(w, len(nll) + 1), smooth, lw=1.6, color=line.get_color(),
                label=f"{log['init']} (last {w}: {smooth[-1]:.3f})")
        print(f"{log['init']}: first {nll[0]:.4f}, mean of last {w} {smooth[-1]:.4f}")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token NLL (train)")
    ax.set_title("Downcycling SmolLM2-135M: initialisations", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(args.out)


if __name__ == "__main__":
    main()

"""Report of a hierarchical conversion: routed sub-expert loads as PNG, a JSON summary with the
calibration tokens each expert was profiled on (and which fell back to all tokens)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from cmoe_jax.atomic_files import write_json_atomic
from cmoe_jax.methods.cmoe.report import plot_expert_load


def summary(records, plan_name: str, stage_seconds: dict) -> dict:
    layers = []
    for i, r in enumerate(records):
        if not r.experts:
            continue
        load = np.asarray(r.load, np.int64)  # [N, N'_r]
        share = load / np.maximum(load.sum(axis=1, keepdims=True), 1)
        layers.append({"layer": i, "tokens_per_expert": [int(e.tokens) for e in r.experts],
                       "fallback_experts": [j for j, e in enumerate(r.experts) if e.fallback],
                       "sub_load": load.tolist(),
                       "sub_share_max": float(share.max()),
                       "kmeans_iterations": [int(e.carving.iterations) for e in r.experts],
                       "seconds": r.seconds})
    return {"config": plan_name, "stage_seconds": stage_seconds, "layers": layers}


def write_hier_report(records, plan_name: str, stage_seconds: dict, directory: Path) -> dict:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    s = summary(records, plan_name, stage_seconds)
    flat = [SimpleNamespace(load=np.asarray(r.load).ravel()) for r in records if r.experts]
    plot_expert_load(flat, directory / "sub_expert_load.png")
    write_json_atomic(directory / "report.json", s)
    return s

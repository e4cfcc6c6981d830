"""ConMoE's cross-layer structure of one base, from the weights and cached statistics only:
per scope size, the share of experts whose nearest expert (by d) lies in another layer, the
spread of d, and how many prototypes adaptive selection gives each layer at rho 50%.

    python benchmarks/conmoe_neighbours.py --model bases/smollm2-S3A3E8 --stats s3_stats.npz
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from conmoe_table import stats_for  # noqa: E402  (benchmarks/ is on sys.path)
from cmoe_jax.methods.conmoe import conmoe_plans
from cmoe_jax.loading import load_model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--stats", required=True)
    p.add_argument("--ratio", type=float, default=0.5)
    args = p.parse_args()
    lm = load_model(args.model, progress=False)
    stats = stats_for(lm.model, lm.tokenizer, Path(args.stats))
    num_experts = len(next(iter(stats.values())).freq)
    for scope in (1, 2, 4, 8, 30):
        plans, figures = conmoe_plans(lm.model, stats, args.ratio, scope)
        per_layer = [sum(1 for q in plan.info["prototypes"] if q // num_experts == j)
                     for plan in plans for j in range(len(plan.layers))]
        print(json.dumps({"scope": scope, **figures, "prototypes_per_layer": per_layer}), flush=True)


if __name__ == "__main__":
    main()

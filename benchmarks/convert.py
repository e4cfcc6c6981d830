"""Wall time of a full CMoE conversion of SmolLM2-135M, split by stage (model loading excluded).

    python benchmarks/convert.py [--config S1A1E8] [--calib-samples 8] [--seqlen 2048]

Prints one line per stage and, last, the total conversion time; also the process's peak
host memory (ru_maxrss), which is what the README quotes.
"""
from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--config", default="S1A1E8")
    p.add_argument("--calib-samples", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--kmeans-iters", type=int, default=None)
    p.add_argument("--data-path", default=None)
    args = p.parse_args()

    from cmoe_jax.carving import MoEPlan
    from cmoe_jax.convert import convert
    from cmoe_jax.demo import local_wikitext

    data = args.data_path or (str(local_wikitext() / "valid.txt") if local_wikitext() else None)
    with tempfile.TemporaryDirectory() as tmp:
        m = convert(args.model, MoEPlan.parse(args.config), out=Path(tmp) / "out", calib="wikitext2",
                    data_path=data, calib_samples=args.calib_samples, seqlen=args.seqlen,
                    kmeans_iters=args.kmeans_iters, progress=False)
    s = m["seconds"]
    for stage in ("profile", "cluster", "route_and_forward", "save"):
        print(f"{stage:>18}: {s[stage]:7.2f} s")
        if stage == "profile":
            print(f"{'of which attention':>18}: {s['attention']:7.2f} s (the calibration forward "
                  "pass's attention, no CMoE work)")
    print(f"{'model load':>18}: {s['load_model']:7.2f} s (excluded)")
    print(f"peak host memory: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    print(f"{args.config} conversion of {args.model}: {s['convert']:.2f} s")


if __name__ == "__main__":
    main()

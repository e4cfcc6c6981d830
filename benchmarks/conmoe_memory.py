"""Routed-expert bytes on disk and in device memory, before and after ConMoE compression.

Builds compressed models of one base from cached calibration statistics (written by
`benchmarks/conmoe_table.py --stats`), saves each as `python -m cmoe_jax.compress` does
(`save_converted`), restores it with `load_model` and reports: the Orbax state directory's
size, the routed-expert bytes of the restored state (a scope's tied table counted once) and
the device bytes the restore added (all live arrays after minus before).

    python benchmarks/conmoe_memory.py --model bases/smollm2-S3A3E8 --stats s3_stats.npz
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
from pathlib import Path

import jax

from conmoe_table import stats_for  # noqa: E402  (benchmarks/ is on sys.path)
from cmoe_jax.checkpoint import save_converted
from cmoe_jax.methods.conmoe import apply_plans, conmoe_plans, routed_bytes
from cmoe_jax.methods.conmoe.job import dir_bytes
from cmoe_jax.loading import load_model

VARIANTS = [(0.25, 1), (0.5, 1), (0.5, 4), (0.5, 30)]


def restored_figures(directory: Path) -> dict:
    gc.collect()
    before = sum(a.nbytes for a in jax.live_arrays())
    model = load_model(str(directory), progress=False).model
    live = sum(a.nbytes for a in jax.live_arrays()) - before  # what the restore added
    figures = {"state_disk_bytes": dir_bytes(directory / "state"), "routed_bytes": routed_bytes(model),
               "live_device_bytes": live}
    del model
    return figures


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--stats", required=True)
    args = p.parse_args()
    print(json.dumps({"variant": "base", **restored_figures(Path(args.model)),
                      "load": os.getloadavg()[0]}), flush=True)
    lm = load_model(args.model, progress=False)
    stats = stats_for(lm.model, lm.tokenizer, Path(args.stats))
    with tempfile.TemporaryDirectory() as tmp:
        for ratio, scope in VARIANTS:
            plans, _ = conmoe_plans(lm.model, stats, ratio, scope)
            out = Path(tmp) / f"r{ratio}s{scope}"
            save_converted(apply_plans(lm.model, plans), {"method": "compress"}, out)
            del plans
            print(json.dumps({"variant": f"conmoe rho={ratio} scope={scope}", **restored_figures(out),
                              "load": os.getloadavg()[0]}), flush=True)


if __name__ == "__main__":
    main()

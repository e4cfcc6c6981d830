"""Seconds and peak resident memory of `load_model` (weights and tokenizer), this tree against a
baseline tree (another checkout of the package, e.g. a git worktree of an earlier commit),
each load in a fresh process, the two sides interleaved.

    git worktree add /tmp/base <commit>
    python benchmarks/load_time.py --model qwen2.5-coder-1.5b --baseline-tree /tmp/base --repeats 2

Prints every load (seconds, peak RSS from `wait4`, against the model's float32 weights), the
median ratio baseline / this tree, and the load average at start and end
(`benchmarks/harness.py`: no ratio is printed when the machine was busy at the start).
Without --baseline-tree only this tree is timed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import load_average, print_load  # noqa: E402

GIB = 2**30
_CHILD = """
import json, sys, time
import jax
from flax import nnx
from cmoe_jax import load_model
began = time.perf_counter()
lm = load_model(sys.argv[1], progress=False)
seconds = time.perf_counter() - began
params = sum(x.size for x in jax.tree.leaves(nnx.state(lm.model)))
print(json.dumps({"seconds": seconds, "params": params}))
"""


def load_once(model: str, tree: Path) -> dict:
    """One load in a fresh process: its seconds, parameter count and peak RSS (`wait4`)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, model], cwd=tree, env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"error: loading {model} from {tree} failed:\n{err.read()[-2000:]}")
    row = json.loads(out.strip().splitlines()[-1])
    row["peak_rss_gib"] = round(usage.ru_maxrss * 1024 / GIB, 3)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--baseline-tree", type=Path)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    sides = {"this tree": ROOT} | ({"baseline": args.baseline_tree} if args.baseline_tree else {})
    load_start, rows = load_average(), []
    for r in range(args.repeats):
        for name, tree in (sides.items() if r % 2 == 0 else reversed(list(sides.items()))):
            row = load_once(args.model, tree) | {"side": name, "repeat": r, "load": round(load_average(), 2)}
            row["peak_over_fp32_weights"] = round(row["peak_rss_gib"] * GIB / (4 * row["params"]), 3)
            rows.append(row)
            print(f"{name:10s} repeat {r}: {row['seconds']:6.1f} s, peak {row['peak_rss_gib']:.2f} GiB "
                  f"({row['peak_over_fp32_weights']:.2f}x the fp32 weights), load {row['load']}", flush=True)
    busy = print_load(load_start, args.repeats, ratio=len(sides) > 1)
    if len(sides) > 1 and not busy:
        med = {s: statistics.median(x["seconds"] for x in rows if x["side"] == s) for s in sides}
        print(f"baseline / this tree: {med['baseline'] / med['this tree']:.2f}x (median seconds)")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "date": time.strftime("%Y-%m-%d"),
                                         "load_at_start": round(load_start, 2), "loads": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Seconds per converted layer of a real model and where they go, this tree against a baseline
tree (another checkout, e.g. a git worktree of an earlier commit), each conversion in a fresh
process, the sides interleaved.

    git worktree add /tmp/base <commit>
    python benchmarks/layer_seconds.py --model qwen2.5-coder-1.5b --config S3A3E8 \
        --variants defaults authors --layers 2 --baseline-tree /tmp/base --repeats 2

Each process loads the model, converts its first `--layers` layers in memory on the
project's 8 calibration windows of 2048 WikiText-2 validation tokens (`--data-dir`) with an
ablation variant (`benchmarks/cmoe_ablation.py`: `defaults`, the `authors` carving, ...) and
stops; the variant `authors-mirror` is the authors' conversion as the torch mirror runs it
(`benchmarks/cmoe_authors_reference.py`, the `transformers` model on the same file and
windows), the baseline of the conversion-time goal, run on this tree's side only. Printed
per process: the last layer's seconds (the first one also compiles the steps) and, over all
its layers, the seconds of each phase: the FFN profile, the carving, the router and gate
fits, the down fit's sums and its solve, the layer's stream error (the converted layer run
on the calibration batch, and the dense one where the down fit did not make its output) and
the rest (attention, slicing). Then per variant the median ratio baseline / this tree of the
last layer's seconds and, with `authors-mirror` among the variants, each one's seconds per
layer over the mirror's, with the load average at start and end (`benchmarks/harness.py`:
no ratio when the machine was busy at the start). Without --baseline-tree only this tree runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import WIKITEXT, load_average, print_load  # noqa: E402

_CHILD = """
import collections, functools, json, sys, time
from pathlib import Path
from benchmarks import cmoe_ablation as ablation
from benchmarks.cmoe_authors_reference import calibration
from cmoe_jax.convert import convert_model
from cmoe_jax.loading import load_model
from cmoe_jax.methods.cmoe import convert as cmoe_convert, layer_fit

model, config, variant, layers, data_dir = sys.argv[1:]
layers = int(layers)
phases = collections.defaultdict(float)

def timed(module, name, phase):
    f = getattr(module, name)
    def wrapped(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            phases[phase] += time.perf_counter() - t0
    setattr(module, name, functools.wraps(f)(wrapped))

lm = load_model(model, progress=False)
class Args:
    max_windows = 1
Args.data_dir = Path(data_dir)
valid, bos, _ = ablation.windows(lm, Args)
calib = calibration(valid, bos, variant, n=8)
with ablation.carving_of(variant):
    for module, name, phase in [(cmoe_convert, "layer_profile", "profile"), (cmoe_convert, "carve_profiled", "carve"),
                                (cmoe_convert, "stream_error", "error"), (layer_fit, "fit_router_scales", "router fit"),
                                (layer_fit, "fit_gate_scales", "gate fit"), (layer_fit, "fit_down", "down fit"),
                                (layer_fit, "solve_down", "down solve")]:
        timed(module, name, phase)
    marks = [time.perf_counter()]
    class Stop(Exception):
        pass
    def on_layer(i, record):
        marks.append(time.perf_counter())
        if i + 1 >= layers:
            raise Stop
    try:
        convert_model(lm.model, calib, ablation.variant_config(config, variant), progress=False, on_layer=on_layer)
    except Stop:
        pass
phases["down fit"] -= phases["down solve"]  # the solve is timed inside the fit
total = marks[-1] - marks[0]
# `stream_error` is given the two streams: in a tree that runs them inside it, they count there
phases["rest"] = total - sum(phases.values())
print(json.dumps({"layer_s": marks[-1] - marks[-2], "total_s": total, "phases": dict(phases)}))
"""

# The authors' conversion as the torch mirror runs it (`benchmarks/cmoe_authors_reference.py`):
# the `transformers` model reading the same file, the same 8 calibration windows.
_MIRROR_CHILD = """
import collections, functools, json, sys, time
from pathlib import Path
import torch
from benchmarks import cmoe_authors_reference as mirror
from benchmarks.torch_reference import load_torch_causal_lm
from cmoe_jax.data import load_text_tokens
from cmoe_jax.jobs.source import SourceModel
from cmoe_jax.methods.cmoe import MoEPlan

model, config, variant, layers, data_dir = sys.argv[1:]
layers = int(layers)
phases = collections.defaultdict(float)
for name, phase in [("profile", "profile"), ("authors_carving", "carve")]:
    f = getattr(mirror, name)
    def wrapped(*a, _f=f, _phase=phase, **k):
        t0 = time.perf_counter()
        try:
            return _f(*a, **k)
        finally:
            phases[_phase] += time.perf_counter() - t0
    setattr(mirror, name, wrapped)
source = SourceModel(model)
valid = load_text_tokens("wikitext2", source.tokenizer, "validation", Path(data_dir) / "valid.txt")
calib = mirror.calibration(valid, None, "defaults", n=8)
lm = load_torch_causal_lm(Path(source.path)).eval()
plan = MoEPlan.parse(config)
marks = [time.perf_counter()]
class Stop(Exception):
    pass
def on_layer(i):
    marks.append(time.perf_counter())
    if i + 1 >= layers:
        raise Stop
try:
    mirror.convert(lm, calib, plan.shared, plan.active, plan.total, on_layer=on_layer)
except Stop:
    pass
total = marks[-1] - marks[0]
phases["rest"] = total - sum(phases.values())
print(json.dumps({"layer_s": marks[-1] - marks[-2], "total_s": total, "phases": dict(phases),
                  "torch_threads": torch.get_num_threads()}))
"""
MIRROR = "authors-mirror"


def run_once(tree: Path, args, variant: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    child = _MIRROR_CHILD if variant == MIRROR else _CHILD
    out = subprocess.run([sys.executable, "-c", child, args.model, args.config, variant, str(args.layers),
                          str(args.data_dir)], cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"error: the conversion in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--config", default="S3A3E8")
    p.add_argument("--variants", nargs="+", default=["defaults", "authors"])
    p.add_argument("--layers", type=int, default=2, help="layers converted per process (at least 2)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--data-dir", type=Path, default=WIKITEXT, help="folder with WikiText-2's valid.txt")
    p.add_argument("--baseline-tree", type=Path)
    p.add_argument("--json", type=Path, help="write every run as JSON")
    args = p.parse_args(argv)
    if args.layers < 2:
        p.error("--layers must be at least 2: the first layer also compiles the steps")
    trees = {"this tree": ROOT} | ({"baseline": args.baseline_tree.resolve()} if args.baseline_tree else {})
    load_start = load_average()
    runs = []
    for repeat in range(args.repeats):
        for variant in args.variants:
            for side, tree in trees.items():
                if variant == MIRROR and side != "this tree":  # the mirror is not the tree's code
                    continue
                r = run_once(tree, args, variant) | {"side": side, "variant": variant, "repeat": repeat,
                                                     "load": load_average()}
                runs.append(r)
                phases = ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items())
                print(f"{variant:>10} {side:>9}: last layer {r['layer_s']:.1f} s, {args.layers} layers "
                      f"{r['total_s']:.1f} s ({phases}); load {r['load']:.2f}", flush=True)
    busy = print_load(load_start, len(runs), ratio=bool(args.baseline_tree))
    if args.baseline_tree and not busy:
        for variant in (v for v in args.variants if v != MIRROR):
            med = {side: statistics.median(r["layer_s"] for r in runs if r["side"] == side and r["variant"] == variant)
                   for side in trees}
            print(f"{variant}: seconds per layer, baseline / this tree: {med['baseline'] / med['this tree']:.2f}x "
                  f"({med['baseline']:.1f} / {med['this tree']:.1f} s)")
    if MIRROR in args.variants and not busy:
        mirror = statistics.median(r["layer_s"] for r in runs if r["variant"] == MIRROR)
        for variant in args.variants:
            own = statistics.median(r["layer_s"] for r in runs if r["variant"] == variant and r["side"] == "this tree")
            print(f"{variant}: seconds per layer / the authors' mirror's: {own / mirror:.2f}x ({own:.1f} / {mirror:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "config": args.config, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()

"""Wall time and peak resident memory of whole conversions of a real model, each variant in a
fresh process (its peak is its own), in memory and streamed.

    python benchmarks/scale_convert.py --model qwen2.5-coder-1.5b \
        --data-path wiki.valid.raw --variants cmoe-S3A3E8 cmoe-S3A3E8-stream --json out.json

A variant is `METHOD-PLAN[-stream]`: METHOD `cmoe` or `expertweaver`, PLAN a config such as
S3A3E8, `active0.25` (a budget: `--active 0.25`) or `default` (expertweaver's own). Each runs
`python -m cmoe_jax.convert` with the calibration given here (the project's defaults: 8
windows of 2048 tokens; expertweaver its own, 32 WikiText-2 articles of 2 x 256 tokens),
and the script prints per variant the wall seconds and the peak RSS (`wait4`'s ru_maxrss)
against the model's float32 weights, with the load average at start and end
(`benchmarks/harness.py`): one side per process, so no ratio of times is claimed under
load, only memory, which load does not change. The streamed peak should be a few layers,
not the model (`--stream` reads, converts and writes one layer at a time).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import load_average, print_load  # noqa: E402

GIB = 2**30


def convert_args(variant: str) -> list[str]:
    """The `cmoe_jax.convert` flags of a variant name."""
    parts = variant.split("-")
    stream = parts[-1] == "stream"
    method, plan = parts[0], "-".join(parts[1:-1] if stream else parts[1:])
    if method not in ("cmoe", "expertweaver"):
        raise SystemExit(f"error: unknown method in variant {variant!r}: cmoe or expertweaver")
    args = ["--method", method]
    if plan.startswith("active"):
        args += ["--active", plan.removeprefix("active")]
    elif plan != "default":
        args += ["--config", plan]
    return args + (["--stream"] if stream else [])


def fp32_weight_bytes(model: str) -> int:
    """4 bytes for every parameter the dense model's config implies."""
    import jax
    from flax import nnx

    from cmoe_jax.loading import load_config
    from cmoe_jax.models import Decoder

    cfg, _ = load_config(model)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    return 4 * sum(x.size for x in jax.tree.leaves(nnx.state(abstract)))


def run_variant(variant: str, args, work: Path) -> dict:
    out = work / variant
    calibration = ([] if variant.startswith("expertweaver") else  # its own: 32 tasks x 2 x 256 tokens
                   ["--calib-samples", str(args.calib_samples), "--seqlen", str(args.seqlen)])
    cmd = [sys.executable, "-m", "cmoe_jax.convert", "--model", args.model, *convert_args(variant),
           *calibration, "--seed", str(args.seed), "--out", str(out), "--no-progress"]
    if args.data_path:
        cmd += ["--data-path", args.data_path]
    start, began = load_average(), time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - began
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"error: variant {variant} failed:\n{stderr[-2000:]}")
    return {"variant": variant, "command": " ".join(cmd[1:]), "seconds": round(seconds, 1),
            "peak_rss_gib": round(usage.ru_maxrss * 1024 / GIB, 3), "load_at_start": round(start, 2),
            "out": str(out)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--data-path")
    p.add_argument("--variants", nargs="+", default=["cmoe-S3A3E8", "cmoe-S3A3E8-stream"])
    p.add_argument("--calib-samples", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, help="keep the converted models here (default: a temporary folder)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    for v in args.variants:
        convert_args(v)  # bad names fail before any work
    weights = fp32_weight_bytes(args.model)
    load_start, rows = load_average(), []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for v in args.variants:
            row = run_variant(v, args, work)
            row["peak_over_fp32_weights"] = round(row["peak_rss_gib"] * GIB / weights, 3)
            rows.append(row)
            print(f"{v:28s} {row['seconds']:8.1f} s  peak {row['peak_rss_gib']:6.2f} GiB "
                  f"({row['peak_over_fp32_weights']:.2f}x the fp32 weights)", flush=True)
    print(f"model {args.model}: fp32 weights {weights / GIB:.2f} GiB")
    print_load(load_start, 1, ratio=False)
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "fp32_weight_gib": round(weights / GIB, 3),
                                         "calib_samples": args.calib_samples, "seqlen": args.seqlen,
                                         "cpu": _cpu(), "date": time.strftime("%Y-%m-%d"),
                                         "load_at_start": round(load_start, 2), "runs": rows}, indent=1))


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()

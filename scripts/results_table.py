"""The README's results table, made by running it: dense and each demo row over several
calibration seeds, reported as the mean and spread of WikiText-2 test perplexity.

    python scripts/results_table.py --seeds 0 1 2 --max-windows 40 --out results.json [--write-readme]

Each row converts exactly as `cmoe-jax convert` with the row's flags (`cmoe_jax.demo.row_job`),
once per `--seed` (the seed draws the calibration windows), and is evaluated on the same test
windows. `--write-readme` replaces the table between the README's `results-table` markers; the
JSON (every seed's figure) and a PNG of the spread are written beside `--out`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

from cmoe_jax.convert import convert
from cmoe_jax.data import load_text_tokens, text_windows
from cmoe_jax.demo import DEFAULT_CONFIGS, data_files, parse_args, row_job
from cmoe_jax.eval import perplexity
from cmoe_jax.loading import load_model

README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- results-table: begin -->", "<!-- results-table: end -->"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown CPU"


def measure(demo_args, seeds: list[int]) -> list[dict]:
    test_path, valid_path = data_files(demo_args)
    dense = load_model(demo_args.model, progress=False)
    tokens = load_text_tokens("wikitext2", dense.tokenizer, split="test", data_path=test_path)
    windows = text_windows(tokens, demo_args.seqlen, max_windows=demo_args.max_windows)
    rows = [{"model": "dense", "ppl": [perplexity(dense.model, windows)["ppl"]]}]
    print(f"dense: {rows[0]['ppl'][0]:.3f}", flush=True)
    del dense
    with tempfile.TemporaryDirectory() as tmp:
        for spec, name, flags in demo_args.rows:
            row = {"model": spec, "flags": flags, "seeds": seeds, "ppl": []}
            for seed in seeds:
                demo_args.seed = seed
                out = Path(tmp) / f"{name}_{len(rows)}_{seed}"
                convert(demo_args.model, row_job(flags, demo_args, valid_path), out=out, progress=False)
                row["ppl"].append(perplexity(load_model(str(out), progress=False).model, windows)["ppl"])
                print(f"{spec} seed {seed}: {row['ppl'][-1]:.3f}", flush=True)
            rows.append(row)
    return rows


def shown_command(argv: list[str]) -> str:
    """The command as the README shows it: data paths as the guides name them."""
    shown = list(argv)
    for i, arg in enumerate(shown[:-1]):
        if arg == "--data-path":
            shown[i + 1] = "data/wiki.test.raw"
    return shlex.join(shown)


def markdown(rows: list[dict], a, machine: str) -> str:
    dense = rows[0]["ppl"][0]
    one = len(a.seeds) == 1
    drawn = (f"seed {a.seeds[0]}, with the conversion's defaults" if one else
             f"seeds {', '.join(map(str, a.seeds))}: mean, and min - max over the seeds")
    lines = [f"WikiText-2 test perplexity on the first {a.max_windows} windows of {a.seqlen} tokens, "
             f"fp32; each conversion calibrated on {a.calib_samples} x {a.seqlen} validation tokens "
             f"drawn with {drawn}. Made by "
             f"`python scripts/results_table.py {shown_command(sys.argv[1:])}` on "
             f"{date.today().isoformat()}, {machine} ({os.cpu_count()} cores).", ""]
    if one:
        lines += ["| model | WikiText-2 ppl | x dense |", "|---|---|---|", f"| dense | {dense:.3f} | 1.00x |"]
    else:
        lines += ["| model | WikiText-2 ppl (mean) | min - max over seeds | x dense |", "|---|---|---|---|",
                  f"| dense | {dense:.3f} | - | 1.00x |"]
    for row in rows[1:]:
        p, mean = row["ppl"], statistics.mean(row["ppl"])
        label = row["model"].replace(":energy", ", `--shared-by energy`")
        spread = "" if one else f" {min(p):.3f} - {max(p):.3f} |"
        lines.append(f"| {label} | {mean:.3f} |{spread} {mean / dense:.2f}x |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for i, row in enumerate(rows):
        ax.scatter([i] * len(row["ppl"]), row["ppl"], color="tab:blue")
    ax.set_xticks(range(len(rows)), [r["model"] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("WikiText-2 ppl (each seed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_readme(table: str) -> None:
    text = README.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"error: README.md has no {BEGIN} ... {END} block to replace")
    head, rest = text.split(BEGIN, 1)
    README.write_text(f"{head}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--max-windows", type=int, default=40)
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--calib-samples", type=int, default=8)
    p.add_argument("--data-path", help="WikiText-2 test text (validation text found beside it)")
    p.add_argument("--out", default="results_table.json", help="JSON of every seed's figure (PNG beside it)")
    p.add_argument("--write-readme", action="store_true")
    a = p.parse_args()
    demo_argv = ["--max-windows", str(a.max_windows), "--configs", a.configs, "--seqlen", str(a.seqlen),
                 "--calib-samples", str(a.calib_samples)]
    demo_args = parse_args(demo_argv + (["--data-path", a.data_path] if a.data_path else []))
    rows = measure(demo_args, a.seeds)
    machine = cpu_model()
    out = Path(a.out)
    out.write_text(json.dumps({"machine": machine, "date": date.today().isoformat(),
                               "windows": a.max_windows, "rows": rows}, indent=1))
    plot(rows, out.with_suffix(".png"))
    table = markdown(rows, a, machine)
    print(table)
    if a.write_readme:
        write_readme(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

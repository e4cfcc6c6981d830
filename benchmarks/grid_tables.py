"""Compact markdown tables of one or more `benchmarks/moe_grid.py` runs, side by side: one
table per dtype and shape, a row per token count, a column per configuration, each cell the
dense/MoE ratio of every run ("1.02 / 0.98") and the path the layer took, the ideal in the
header. A figure is quoted once two runs agree, so the runs sit in one cell.

    python benchmarks/grid_tables.py run1.json run2.json            # the layer's own path
    python benchmarks/grid_tables.py run1.json run2.json --path dense   # one forced path
    python benchmarks/grid_tables.py run1.json run2.json --path rule    # what the rule takes now

`--path rule` reads each cell at the path `cmoe_jax.moe.modes` picks today, from the forced
paths' columns timed in the same run ("-" where that path was not timed): the tables of a
run made before the rule changed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rule_path(cell: dict) -> str:
    """The path the current rule takes for the cell (imports jax)."""
    from benchmarks.moe_grid import DTYPES, auto_path
    return auto_path(cell["tokens"], cell["config"], DTYPES[cell["dtype"]], cell["shape"])


def ratio(cell: dict, path: str) -> str:
    if path == "rule":
        path = rule_path(cell)
        path = "auto" if path not in cell["moe_s"] and cell["auto_path"] == path else path
    t = cell["moe_s"].get(path)
    if t is None:
        return "-"
    flag = "" if not cell.get("busy") else "*"
    return f"{cell['dense_s'] / t:.2f}{flag}"


def tables(runs: list[dict], path: str) -> str:
    key = lambda c: (c["dtype"], c["shape"], c["tokens"], c["config"])  # noqa: E731
    index = [{key(c): c for c in run["cells"]} for run in runs]
    first = runs[0]["cells"]
    configs = list(dict.fromkeys(c["config"] for c in first))
    ideal = {c["config"]: c["ideal"] for c in first}
    out = []
    for dtype, shape in dict.fromkeys((c["dtype"], c["shape"]) for c in first):
        out += [f"\n{shape}, {dtype}: dense time / MoE time ({path}), "
                f"{' / '.join(f'run {i + 1}' for i in range(len(runs)))}\n",
                "| tokens | " + " | ".join(f"{c} (ideal {ideal[c]:.2f}x)" for c in configs) + " |",
                "|---" * (len(configs) + 1) + "|"]
        for tokens in dict.fromkeys(c["tokens"] for c in first if (c["dtype"], c["shape"]) == (dtype, shape)):
            row = []
            for config in configs:
                cells = [ix.get((dtype, shape, tokens, config)) for ix in index]
                if cells[0] is None:
                    row.append("-")
                    continue
                ratios = " / ".join(ratio(c, path) if c else "-" for c in cells)
                taken = ({c["auto_path"] for c in cells if c} if path == "auto" else
                         {rule_path(c) for c in cells if c} if path == "rule" else set())
                row.append(ratios + (f" ({', '.join(sorted(taken))})" if taken else ""))
            out.append(f"| {tokens} | " + " | ".join(row) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="moe_grid.py --out JSON files")
    p.add_argument("--path", default="auto", help="which timed path's ratio (default: auto)")
    args = p.parse_args(argv)
    runs = []
    for f in args.runs:
        try:
            runs.append(json.loads(f.read_text()))
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: cannot read grid results {f}: {e}")
    for run in runs:
        load = run.get("load_at_start")
        print(f"# {run['machine']}, {run['date']}" + (f", load {load:.2f} at start" if load is not None else ""))
    print(tables(runs, args.path))
    return 0


if __name__ == "__main__":
    sys.exit(main())

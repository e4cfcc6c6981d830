"""The README's ConMoE table: WikiText-2 perplexity and ARC-Easy accuracy of every variant.

Loads the base once, collects the calibration statistics once (the CLI's defaults: 8 x 2048
WikiText-2 validation tokens, seed 0; cached in --stats), then builds each variant in memory
(`conmoe_plans` / `baseline_plans`, exactly the plans `python -m cmoe_jax.compress` saves) and
measures its perplexity on the first --windows WikiText-2 test windows of 2048 tokens (the
protocol of `python -m cmoe_jax.eval --dataset wikitext2 --max-windows N`) and, with
--arc-path, its ARC-Easy accuracy on the first --arc-limit questions (`python -m cmoe_jax.eval
--task arc_easy --limit N`). Variants without pruned slots are evaluated as the copied
checkpoint (`materialize`: the base's shapes, so one compilation serves them all; equal to the
prototype runtime to fp32 tolerance, tests/test_compress.py), pruning variants on the
prototype runtime (`apply_plans`). One JSON line per variant goes to --out; a rerun skips the
metrics a variant already has and adds the missing ones (e.g. ARC to a perplexity table).

    python benchmarks/conmoe_table.py --model bases/smollm2-S3A3E8 --out s3.jsonl --stats s3.npz \
        --windows 8 --arc-path ../shared/data/arc-easy/test.jsonl --arc-limit 500
    python benchmarks/conmoe_table.py --markdown s3.jsonl      # the README table from the lines
    python benchmarks/conmoe_table.py --model runs/h-s3 --variants core ...  # a hierarchical model
    python benchmarks/conmoe_table.py --model bases/smollm2-S3A3E8 --variants rules ...

`--variants rules`: ConMoE's options against its paper form at scope 1 (REAP's kept experts
remapped instead of masked, the duplicate-gate rules, the output distance).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import WIKITEXT  # noqa: E402
from cmoe_jax.methods.conmoe import apply_plans, collect_stats, materialize, routed_bytes
from cmoe_jax.methods.conmoe import CompressConfig, make_plans
from cmoe_jax.methods.conmoe import LayerStats
from cmoe_jax.data import calibration_windows, eval_windows, load_text_tokens
from cmoe_jax.eval.perplexity import perplexity
from cmoe_jax.eval.tasks import evaluate_task, get_task, load_documents
from cmoe_jax.loading import load_model

CORE = [("conmoe", 1, "adaptive"), ("frequency", 1, ""), ("reap", 1, ""), ("conmoe", 4, "adaptive"),
        ("msmoe", 1, ""), ("hcsmoe", 1, "")]
MORE = [("conmoe", 4, "fixed"), ("conmoe", 4, "usage"), ("conmoe", 4, "reap"),
        ("conmoe", 4, "distance"), ("conmoe", 2, "adaptive"), ("conmoe", 8, "adaptive"),
        ("conmoe", 30, "adaptive")]
# (method, scope, selection, distance, duplicate gates): each option once against the paper's form
RULES = [("conmoe", 1, "reap", "weights", "sum"), ("conmoe", 1, "adaptive", "weights", "max"),
         ("conmoe", 1, "adaptive", "weights", "renorm"), ("conmoe", 1, "reap", "weights", "max"),
         ("conmoe", 1, "adaptive", "outputs", "sum"), ("conmoe", 1, "adaptive", "outputs", "max"),
         ("msmoe", 1, "", "weights", "max"), ("hcsmoe", 1, "", "weights", "max")]
BASE = ("base", 0.0, 1, "", "weights", "sum")
GROUPS = {"core": (CORE,), "all": (CORE, MORE), "rules": (CORE[:3], RULES)}


def variants(ratios, groups=(CORE, MORE)):
    """Keys (method, ratio, scope, selection, distance, duplicate gates) of the groups' variants."""
    for group in groups:
        for ratio in ratios:
            for method, scope, selection, *rest in group:
                distance, gates = rest or ("weights", "sum")
                yield method, ratio, scope, selection, distance, gates


def job_of(key) -> CompressConfig:
    method, ratio, scope, selection, distance, gates = key
    return CompressConfig(method=method, ratio=ratio, scope=scope, selection=selection or "adaptive",
                          distance=distance, duplicate_gates=gates)


def stats_for(model, tokenizer, cache: Path, data_dir: str = str(WIKITEXT)):
    if cache.exists():
        with np.load(cache) as z:
            layers = sorted({int(k.split("/")[0]) for k in z.files})
            return {l: LayerStats.from_npz({f: z[f"{l}/{f}"] for f in
                                            ("freq", "contrib", "mean_out", "logit_gram", "tokens")})
                    for l in layers}
    windows = calibration_windows(load_text_tokens("wikitext2", tokenizer, data_path=f"{data_dir}/valid.txt"),
                                  8, 2048, 0)
    stats = collect_stats(model, windows)
    np.savez(cache, **{f"{l}/{k}": v for l, s in stats.items() for k, v in s.to_npz().items()})
    return stats


def build_variant(model, stats, key):
    """(model to evaluate, figures, prototypes kept, routed bytes of the prototype runtime)."""
    if key[0] == "base":
        return model, {}, sum(len(s.freq) for s in stats.values()), routed_bytes(model)
    job = job_of(key)
    plans, figures = make_plans(model, stats, job)  # the CLI's own
    runtime = apply_plans(model, plans, job.duplicate_gates)
    kept, nbytes = sum(p.num_prototypes for p in plans), routed_bytes(runtime)
    if job.duplicate_gates != "sum" or any((p.slot_maps[l] < 0).any() for p in plans for l in p.layers):
        return runtime, figures, kept, nbytes  # only the runtime masks pruned slots or merges gates
    del runtime
    return materialize(model, plans), figures, kept, nbytes


def load_rows(out: Path) -> dict:
    rows = {}
    if out.exists():
        for line in out.read_text().splitlines():
            row = json.loads(line)
            key = tuple(row["key"]) + ("weights", "sum")[len(row["key"]) - 4:]  # 4-field keys: defaults
            rows.setdefault(key, {}).update(row, key=list(key))
    return rows


def write_rows(out: Path, rows: dict) -> None:
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows.values()))
    os.replace(tmp, out)


def markdown(rows: dict) -> str:
    """The README table: one line per variant in the order measured, ratios against the base."""
    base = rows.get(BASE, {})
    total = base.get("prototypes")
    lines = ["| method | rho | scope | selection | kept | PPL | vs base | ARC acc | ARC acc_norm "
             "| cross-NN | d spread (min / mean / max) |", "|" + "---|" * 11]
    for (method, ratio, scope, selection, distance, gates), r in rows.items():
        options = [o for o, default in ((f"d={distance}", "d=weights"), (f"gates={gates}", "gates=sum"))
                   if o != default]
        selection = ", ".join([selection] * bool(selection) + options)
        ppl = r.get("ppl")
        ratio_ppl = f"{ppl / base['ppl']:.3f}x" if ppl and base.get("ppl") else ""
        arc = r.get("arc", {})
        cross = r.get("cross_layer_nn_fraction")
        spread = (f"{r['distance_min']:.3f} / {r['distance_mean']:.3f} / {r['distance_max']:.3f}"
                  if r.get("distance_min") is not None else "")
        lines.append(" | ".join([
            f"| {method}", f"{ratio:g}" if ratio else "0", str(scope) if method == "conmoe" else "",
            selection, f"{r.get('prototypes')}/{total}", f"{ppl:.3f}" if ppl else "", ratio_ppl,
            f"{arc['acc']:.3f}" if arc else "", f"{arc['acc_norm']:.3f}" if arc else "",
            f"{cross:.2f}" if cross is not None else "", spread]) + " |")
    windows = {r.get("windows") for r in rows.values()} - {None}
    items = {r["arc"]["items"] for r in rows.values() if "arc" in r}
    se = max((r["arc"]["acc_stderr"] for r in rows.values() if "arc" in r), default=0.0)
    loads = [r["load"] for r in rows.values() if "load" in r]
    lines.append(f"\nPPL windows {sorted(windows)}, ARC questions {sorted(items)}, largest ARC acc "
                 f"stderr {se:.3f}, load averages {min(loads, default=0):.1f} to {max(loads, default=0):.1f}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--markdown", metavar="JSONL", help="print the README table of a finished run and exit")
    p.add_argument("--model")
    p.add_argument("--out")
    p.add_argument("--stats")
    p.add_argument("--ratios", default="0.5,0.25")
    p.add_argument("--variants", choices=sorted(GROUPS), default="all",
                   help="core: ConMoE layer-local and scope 4 and the four baselines only; rules: "
                        "the selection, gate and distance options at scope 1")
    p.add_argument("--windows", type=int, default=40, help="WikiText-2 test windows (0: no perplexity)")
    p.add_argument("--arc-path", help="ARC-Easy test JSON lines: add each variant's accuracy")
    p.add_argument("--arc-limit", type=int, help="score only the first N ARC-Easy questions")
    p.add_argument("--data-dir", default=str(WIKITEXT),
                   help="folder with WikiText-2 valid.txt and test.txt (default: %(default)s)")
    args = p.parse_args()
    if args.markdown:
        print(markdown(load_rows(Path(args.markdown))))
        return
    if not (args.model and args.out and args.stats):
        p.error("--model, --out and --stats are required (or --markdown JSONL)")
    task = get_task("arc_easy")
    docs = load_documents(task, args.arc_path, args.arc_limit) if args.arc_path else None
    lm = load_model(args.model, dtype=jnp.float32)
    stats = stats_for(lm.model, lm.tokenizer, Path(args.stats), args.data_dir)
    test = (eval_windows(load_text_tokens("wikitext2", lm.tokenizer, data_path=f"{args.data_dir}/test.txt"),
                         "wikitext2", 2048, args.windows, name="wikitext2 test") if args.windows else None)
    out = Path(args.out)
    rows = load_rows(out)
    todo = [BASE] + list(variants([float(r) for r in args.ratios.split(",")], GROUPS[args.variants]))
    for key in todo:
        key = list(key)
        row = rows.get(tuple(key), {"key": key})
        want_ppl = test is not None and row.get("windows") != args.windows
        want_arc = docs is not None and "arc" not in row
        if not (want_ppl or want_arc):
            continue
        t0 = time.perf_counter()
        model, figures, kept, nbytes = build_variant(lm.model, stats, key)
        row.update({"prototypes": kept, "routed_bytes": nbytes, **figures})
        if want_ppl:
            row.update(ppl=perplexity(model, test, progress=False)["ppl"], windows=args.windows)
        if want_arc:
            result = evaluate_task(model, lm.tokenizer.encode, task, docs, progress=False)
            row["arc"] = {k: result[k] for k in ("items", "acc", "acc_stderr", "acc_norm", "acc_norm_stderr")}
            row["arc_seconds"] = result["seconds"]
        row.update(seconds=time.perf_counter() - t0, load=os.getloadavg()[0])
        print(json.dumps(row), flush=True)
        rows[tuple(key)] = row
        write_rows(out, rows)
        del model  # compilations stay cached: copied checkpoints share the base's shapes and the
        gc.collect()  # pruning runtimes of one ratio share theirs, so there are three in all


if __name__ == "__main__":
    main()

"""The quality/speed front of one model: uniform and layer-adaptive CMoE at several budgets.

    python benchmarks/front.py --model smollm2 --out front/smollm2 [--budgets 0.25 0.375 0.5 0.625 0.75]
        [--max-windows 40] [--arc-limit N] [--repeats 3] [--resume]

For each budget F (the share of FFN neurons a token runs): the uniform shape of that share
of 8 experts (S1A1E8 at 0.25, S1A2E8 at 0.375, S2A2E8, S2A3E8, S3A3E8 at 0.75;
`Budget.candidates`) and the adaptive conversion (`convert --active F` with its defaults,
16 experts from F = 0.5; each layer's sensitivity
is measured at each budget's operating point, saved as a cell of its own). Each model is scored on WikiText-2 test perplexity
(`--max-windows` windows of 2048) and ARC-Easy (acc), and timed against the dense model in
the same run: prefill (a batch of 512-token prompts through the model) and decode (128 new
greedy tokens with the KV cache), batch 1 and 16, the two sides interleaved, medians.

Every finished cell is saved as `OUT/cells/NAME.json` at once; `--resume` skips those, so a
killed sweep goes on where it stopped (each cell names its machine and date). Quality and speed are cells of their own
(`uniform-0.25`, `speed-uniform-0.25`), and each converted model is kept in
`OUT/models/NAME` (a converted directory, `load_model` reads it): `--parts quality` can run
on a busy machine, and `--parts speed --resume` later times the kept models on a quiet one
(a speed cell waits up to 90 s for the load average to fall to the core count, records it
at its start and is `busy` above the core count). At the end `OUT/front.json` holds every cell and
`OUT/front.png` the two panels (perplexity and speed against active share, dense as a line).
`--screen F:MEASURE:SPREAD[:EXPERTS] ...` adds allocation variants scored by perplexity
alone (SPREAD `auto`: the band `convert` would choose, each band's held-out loss kept in
`OUT/cells/band-F-Ez.json`); `--budgets` with no value runs only those (and the dense perplexity, no ARC-Easy).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import (DATA, interleaved_times, load_average, machine_busy, machine_line,  # noqa: E402
                                settled_load)

BUDGETS = (0.25, 0.375, 0.5, 0.625, 0.75)


def _save(path: Path, cell: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cell, indent=1))
    tmp.replace(path)


class Front:
    """One model's sweep: the dense model, its windows and damage, each cell cached on disk."""

    def __init__(self, args):
        from cmoe_jax.data import calibration_windows, held_out_windows
        from cmoe_jax.methods.cmoe.job import HELD_OUT_WINDOWS
        from cmoe_jax.loading import load_model

        from benchmarks.cmoe_ablation import windows

        self.args = args
        self.lm = load_model(args.model, progress=False)
        args.data_dir = args.wikitext
        valid, self.bos, self.test = windows(self.lm, args)
        self.calib = calibration_windows(valid, 8, 2048, 0)  # the conversion's defaults
        self.held_out = held_out_windows(valid, 8, 2048, 0, HELD_OUT_WINDOWS)  # `--spread auto`'s
        self.prompts = np.asarray(valid[:16 * 512], np.int32).reshape(16, 512)  # speed only
        self.cells = args.out / "cells"

    def cell(self, name: str, make):
        """The saved cell `name`, or `make()` measured and saved."""
        path = self.cells / f"{name}.json"
        if self.args.resume and path.exists():
            return json.loads(path.read_text())
        t0 = time.perf_counter()
        # a resumed sweep may span machines, and the CPU kind's rounding can move an allocation
        cell = dict(make(), name=name, seconds=round(time.perf_counter() - t0, 1), load_at_end=load_average(),
                    machine=machine_line(), date=time.strftime("%Y-%m-%d"))
        _save(path, cell)
        print(json.dumps({k: v for k, v in cell.items() if k not in ("stream_error", "loss_gain", "loss_rise")}),
              flush=True)
        return cell

    def sensitivity(self, budget):
        """Each layer's stream errors and loss gains: the marginal measure at each budget's
        operating point, the dense-stream ones ("loss", "stream") once for every budget."""
        from cmoe_jax.convert import ConvertConfig
        from cmoe_jax.methods.cmoe.job import Sensitivity, measure_damage

        marginal = budget.measure_by == "marginal"
        measured = budget if marginal else dataclasses.replace(budget, measure_by="loss")  # both measures

        def make():
            s = measure_damage(self.lm.model, self.calib, ConvertConfig(plan=None), measured)
            return {"stream_error": s.errors.tolist(), "loss_gain": s.gains.tolist(),
                    "loss_rise": None if s.rises is None else s.rises.tolist(), "operating": s.operating}

        # the marginal cells hold the rise below the operating point too (older ones do not)
        name = f"damage-{budget.active:g}-E{budget.experts}" if marginal else f"sensitivity-E{budget.experts}"
        cell = self.cell(name, make)
        rises = cell.get("loss_rise")
        return Sensitivity(np.asarray(cell["stream_error"]), np.asarray(cell["loss_gain"]),
                           None if rises is None else np.asarray(rises), cell.get("operating"))

    def adaptive(self, budget):
        """The conversion settings of `budget`'s allocation; with `--spread auto` the band
        chosen as `convert` chooses it, each band's held-out loss kept in a cell of its own."""
        from cmoe_jax.convert import ConvertConfig
        from cmoe_jax.methods.cmoe.job import AUTO, BandRun, adaptive_config, choose_band

        damage = self.sensitivity(budget).damage(budget.measure_by)
        if budget.spread != AUTO:
            return adaptive_config(ConvertConfig(plan=None), budget, damage)
        band = self.cell(f"band-{budget.active:g}-E{budget.experts}", lambda: choose_band(
            self.lm.model, ConvertConfig(plan=None), budget, damage, BandRun(self.calib, self.held_out)).to_json())
        return adaptive_config(ConvertConfig(plan=None), budget.with_spread(band["spread_chosen"]), damage)

    def converted(self, cc):
        from cmoe_jax.convert import convert_model

        return convert_model(copy.deepcopy(self.lm.model), self.calib, cc, progress=True)

    def kept(self, name: str, cc):
        """The model of cell `name`: read from `OUT/models/NAME`, or converted and kept there
        (written beside it, then renamed, so a killed sweep never keeps half a model)."""
        import shutil

        from cmoe_jax.checkpoint.save import save_converted
        from cmoe_jax.loading import load_model
        from cmoe_jax.methods.cmoe.job import active_share, plan_entry

        path = self.args.out / "models" / name
        if path.exists():
            return load_model(str(path), progress=False).model, None
        model, records = self.converted(cc)
        cfg, plans = self.lm.config, cc.layer_shapes(self.lm.config.num_layers)
        experts = next((p.total for p in plans if p is not None), 8)  # a kept dense layer's count
        tmp = path.with_name(name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        save_converted(model, {"source_model": self.args.model, "method": "cmoe", "config": cc.label,
                               "plan": [plan_entry(p, cfg.intermediate_size, experts) for p in plans],
                               "active_share": active_share(plans)}, tmp, tokenizer=self.lm.tokenizer)
        tmp.rename(path)
        return model, records

    def ppl(self, model) -> float:
        from cmoe_jax.eval import perplexity

        return perplexity(model, self.test, progress=False)["ppl"]

    def scores(self, model) -> dict:
        """Perplexity and ARC-Easy accuracy."""
        from cmoe_jax.eval.tasks import evaluate_task, get_task, load_documents

        task = get_task("arc_easy")
        docs = load_documents(task, self.args.arc_path, self.args.arc_limit)
        tok, bos = self.lm.tokenizer, self.bos  # ARC opened by BOS where the family's windows are

        def encode(text):
            return tok.encode(text) if bos is None else [bos, *tok.encode(text)]
        arc = evaluate_task(model, encode, task, docs, progress=False)
        return {"ppl": self.ppl(model), "arc_acc": arc["acc"],
                "arc_acc_stderr": arc.get("acc_stderr"), "arc_questions": len(docs)}

    def speed(self, model) -> dict:
        """dense time / this model's time (medians, interleaved) of prefill and decode."""
        from benchmarks.budget_speed import sides

        load = settled_load()  # the cell before this one leaves its threads in the average
        out, models = {"load_at_start": load, "busy": machine_busy(load)}, {"dense": self.lm.model, "model": model}
        for batch in (1, 16):
            for what, prompts in (("prefill", self.prompts[:batch]), ("decode", self.prompts[:batch, :128])):
                times = interleaved_times(sides(models, what, prompts, 128), self.args.repeats)
                out[f"{what}_b{batch}"] = statistics.median(times[0]) / statistics.median(times[1])
        return out


def variant(spec: str):
    """`--screen F:MEASURE:SPREAD[:EXPERTS]` (e.g. 0.75:loss:2, 0.25:stream:any:16) as a Budget."""
    from cmoe_jax.methods.cmoe.job import Budget

    share, measure, spread, *experts = spec.split(":")
    return Budget(float(share), int(experts[0]) if experts else 8, measure_by=measure,
                  spread=None if spread == "any" else spread if spread == "auto" else int(spread))


def sweep(args) -> list[dict]:
    from cmoe_jax.convert import ConvertConfig
    from cmoe_jax.methods.cmoe.job import Budget
    from cmoe_jax.methods.cmoe.job import active_share

    front = Front(args)
    if args.budgets:  # the front's dense point; the screens need its perplexity alone
        cells = [front.cell("dense", lambda: dict(front.scores(front.lm.model), kind="dense", active_share=1.0))]
    else:
        cells = [front.cell("dense-ppl", lambda: {"kind": "dense-ppl", "ppl": front.ppl(front.lm.model)})]
    for share in args.budgets:
        budget, uniform = Budget(share), Budget(share, 8)  # the defaults; the uniform shape of 8 experts
        kinds = {"uniform": ConvertConfig(plan=uniform.candidates()[uniform.uniform_index()]),
                 "adaptive": front.adaptive(budget)}
        for kind, cc in kinds.items():
            name = f"{kind}-{share:g}"

            def make(cc=cc, kind=kind, name=name):
                model, records = front.kept(name, cc)
                shapes = ["dense" if p is None else p.name
                          for p in cc.layer_shapes(front.lm.config.num_layers)]
                return dict(front.scores(model), kind=kind, budget=share,
                            active_share=active_share(cc.layer_shapes(len(shapes))), shapes=shapes,
                            layer_error=None if records is None else [r.error for r in records])
            cell = front.cell(name, make) if "quality" in args.parts else {}
            if "speed" in args.parts:
                cell = dict(cell, **front.cell("speed-" + name, lambda cc=cc, name=name: front.speed(
                    front.kept(name, cc)[0])))
            if cell.get("kind"):
                cells.append(cell)
    for spec in args.screen:  # allocation variants, perplexity only
        budget = variant(spec)
        cc = front.adaptive(budget)

        def make(cc=cc, budget=budget):
            model, _ = front.converted(cc)
            return {"kind": "screen", "ppl": front.ppl(model),
                    **budget.to_json(), "active_share": active_share(list(cc.layer_plans)),
                    "shapes": ["dense" if p is None else p.name for p in cc.layer_plans]}
        cells.append(front.cell("screen-" + spec.replace(":", "-"), make))
    return cells


def saved_front(cells_dir: Path) -> list[dict]:
    """Every model cell saved under OUT, its speed cell merged in, whichever runs made them:
    a `--parts speed` run of one budget still writes the whole front."""
    saved = {p.stem: json.loads(p.read_text()) for p in sorted(cells_dir.glob("*.json"))}
    return [dict(cell, **{k: v for k, v in saved.get("speed-" + name, {}).items() if k not in cell})
            for name, cell in saved.items() if cell.get("kind")]


def plot(cells: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dense = next(c for c in cells if c["kind"] == "dense")
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, style in (("uniform", "o--"), ("adaptive", "s-")):
        rows = sorted((c for c in cells if c["kind"] == kind), key=lambda c: c["active_share"])
        x = [c["active_share"] for c in rows]
        ax.plot(x, [c["ppl"] for c in rows], style, label=kind)
        for key, color in (("prefill_b1", "tab:blue"), ("prefill_b16", "tab:red"),
                           ("decode_b1", "tab:orange"), ("decode_b16", "tab:green")):
            timed = [c for c in rows if key in c]  # speed cells not measured yet are left out
            bx.plot([c["active_share"] for c in timed], [c[key] for c in timed], style, color=color,
                    label=f"{kind} {key}")
    ax.axhline(dense["ppl"], color="gray", lw=1, label="dense")
    ax.set_yscale("log")
    ax.set(xlabel="active share of FFN neurons", ylabel="WikiText-2 perplexity", title=title)
    ax.legend(fontsize=8)
    bx.axhline(1.0, color="gray", lw=1)
    bx.set(xlabel="active share of FFN neurons", ylabel="dense time / model time", title="speed")
    bx.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(cells: list[dict]) -> str:
    """The front as a table: each cell's share, perplexity, ARC-Easy and speed ratios."""
    rows = ["| kind | active share | shapes | ppl | ARC-Easy acc | prefill b1 | prefill b16 | decode b1 | decode b16 |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in sorted((c for c in cells if c["kind"] in ("dense", "uniform", "adaptive")), key=lambda c: (c["active_share"], c["kind"])):
        shapes = sorted(set(c.get("shapes", ["dense"])))
        busy = " (busy)" if c.get("busy") else ""
        speed = [f"{c[k]:.2f}x{busy}" if k in c else "-" for k in ("prefill_b1", "prefill_b16", "decode_b1", "decode_b16")]
        rows.append(f"| {c['kind']} | {c['active_share']:.3f} | {', '.join(shapes)} | {c['ppl']:.3f} | "
                    f"{c['arc_acc']:.4f} | " + " | ".join(speed) + " |")
    screens = sorted((c for c in cells if c["kind"] == "screen"), key=lambda c: c["name"])
    if screens:
        dense = next(c for c in cells if c["kind"] in ("dense", "dense-ppl"))["ppl"]
        rows += ["", "| budget | experts | damage | spread | ppl | x dense |", "| --- | --- | --- | --- | --- | --- |"]
        rows += [f"| {c['active']:g} | {c['experts']} | {c['sensitivity']} | "
                 f"{c['spread'] if c['spread'] is not None else 'any'} | {c['ppl']:.3f} | {c['ppl'] / dense:.2f}x |"
                 for c in screens]
    return "\n".join(rows)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budgets", type=float, nargs="*", default=None,
                   help=f"budgets of the front (default {' '.join(map(str, BUDGETS))}, or none when "
                        "--screen is given; a bare --budgets: none)")
    p.add_argument("--max-windows", type=int, default=40)
    p.add_argument("--arc-limit", type=int, default=None, help="first N ARC-Easy questions (default all)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--wikitext", type=Path, default=DATA / "wikitext-2", help="valid.txt and test.txt")
    p.add_argument("--arc-path", type=Path, default=DATA / "arc-easy" / "test.jsonl")
    p.add_argument("--screen", nargs="*", default=[], metavar="F:MEASURE:SPREAD[:EXPERTS]",
                   help="allocation variants scored by perplexity alone, e.g. 0.75:loss:2 0.25:stream:any:16 "
                        "0.75:loss:auto:16 (SPREAD: experts, any or auto; EXPERTS: z of every "
                        "candidate shape, default 8)")
    p.add_argument("--parts", nargs="+", choices=("quality", "speed"), default=["quality", "speed"],
                   help="what the budgets' cells measure: quality (convert, keep the model, perplexity, "
                        "ARC-Easy) on any machine, speed (time the kept models) on a quiet one")
    p.add_argument("--resume", action="store_true", help="keep the cells already saved under OUT")
    args = p.parse_args(argv)
    if args.budgets is None:  # a screen alone should not start the whole front
        args.budgets = [] if args.screen else list(BUDGETS)
    if args.out.exists() and not args.resume and any(args.out.glob("cells/*.json")):
        p.error(f"{args.out} holds a sweep already: pass --resume to go on with it")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    print(machine_line(), flush=True)
    sweep(args)
    cells = saved_front(args.out / "cells")
    summary = {"model": args.model, "machine": machine_line(), "date": time.strftime("%Y-%m-%d"),
               "max_windows": args.max_windows, "cells": cells}
    _save(args.out / "front.json", summary)
    if args.budgets:
        plot(cells, args.out / "front.png", args.model)
    print(markdown(cells))


if __name__ == "__main__":
    main()

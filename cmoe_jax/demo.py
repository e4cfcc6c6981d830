"""The README demo: dense vs CMoE perplexity of the embedded SmolLM2-135M on WikiText-2.

    python -m cmoe_jax.demo [--windows 8] [--configs S3A3E8:energy,S2A2E16,S1A1E8]

After a config's name, colon-separated options choose the carving rules of that row (see
`python -m cmoe_jax.convert --help`): `rate` or `energy` (--shared-by), `reps=centroid|energy`
(--router-reps), `r=N` (--router-neurons), `fit=N` (--router-fit-tokens), `paper`
(--paper-router). Without options a row uses the conversion defaults: shared experts by
activation rate, 8 router neurons per expert chosen by output energy, fitted scales.

Uses `../shared/data/wikitext-2/{valid,test}.txt` when present (this project's machines),
otherwise downloads WikiText-2 with `datasets`.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


DEFAULT_CONFIGS = "S3A3E8:energy,S2A2E16,S1A1E8"


def local_wikitext() -> Path | None:
    for base in (Path.cwd(), Path(__file__).resolve().parents[1]):
        d = base.parent / "shared" / "data" / "wikitext-2"
        if (d / "test.txt").exists():
            return d
    return None


_OPTIONS = {"reps": ("router_reps", str), "r": ("router_neurons", int),
            "fit": ("router_fit_tokens", int)}


def parse_config(spec: str) -> tuple[str, dict]:
    """`S3A3E8:energy:reps=energy:r=8` -> ("S3A3E8", convert() keyword arguments)."""
    name, *opts = spec.split(":")
    kwargs = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not eq and key in ("rate", "energy"):
            kwargs["shared_by"] = key
        elif not eq and key == "paper":
            from cmoe_jax.methods.cmoe import ConvertConfig

            kwargs.update(ConvertConfig.PAPER_ROUTER)
        elif eq and key in _OPTIONS:
            arg, kind = _OPTIONS[key]
            try:
                kwargs[arg] = kind(value)
            except ValueError:
                raise ValueError(f"config {spec!r}: {key}={value!r} is not a valid {kind.__name__}") from None
        else:
            raise ValueError(f"config {spec!r}: unknown option {opt!r}; use rate, energy, paper, "
                             f"{', '.join(k + '=...' for k in _OPTIONS)}")
    return name, kwargs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cmoe_jax.demo", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--windows", type=int, default=8,
                   help="test windows of --seqlen tokens (the README table uses 40)")
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="comma-separated SxAyEz[:option...] (default: %(default)s)")
    p.add_argument("--calib-samples", type=int, default=8)
    p.add_argument("--json", help="write the table as JSON here")
    args = p.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]

    from cmoe_jax.methods.cmoe import MoEPlan

    try:  # every row's plan and options are checked before the first (minutes-long) evaluation
        parsed = [parse_config(c) for c in configs]
        plans = [MoEPlan.parse(name) for name, _ in parsed]
    except ValueError as e:
        p.error(str(e))
    from cmoe_jax.convert import convert
    from cmoe_jax.data import load_text_tokens, text_windows
    from cmoe_jax.eval import perplexity
    from cmoe_jax.loading import load_model

    data = local_wikitext()
    test_path = str(data / "test.txt") if data else None
    valid_path = str(data / "valid.txt") if data else None
    print(f"data: {'local ' + str(data) if data else 'WikiText-2 via datasets'}")

    dense = load_model(args.model, progress=False)
    tokens = load_text_tokens("wikitext2", dense.tokenizer, split="test", data_path=test_path)
    windows = text_windows(tokens, args.seqlen, max_windows=args.windows)
    rows = []
    r = perplexity(dense.model, windows)
    rows.append({"model": "dense", "ppl": r["ppl"], "convert_s": None, "tokens_per_s": r["tokens_per_s"]})
    print(f"dense perplexity on {len(windows)} x {args.seqlen} tokens: {r['ppl']:.3f}")
    del dense
    with tempfile.TemporaryDirectory() as tmp:
        for row, (name, plan, (_, options)) in enumerate(zip(configs, plans, parsed)):
            out = Path(tmp) / f"{row}_{plan.name}"  # rows may share a plan with other options
            manifest = convert(args.model, plan, out=out, calib="wikitext2",
                               data_path=valid_path, calib_samples=args.calib_samples,
                               seqlen=args.seqlen, seed=0, progress=False, **options)
            seconds = manifest["seconds"]["convert"]
            moe = load_model(str(out), progress=False)
            r = perplexity(moe.model, windows)
            rows.append({"model": name, "ppl": r["ppl"], "convert_s": seconds,
                         "tokens_per_s": r["tokens_per_s"]})
            print(f"{name}: perplexity {r['ppl']:.3f} (conversion {seconds:.1f} s)")
    base = rows[0]["ppl"]
    print(f"\n| model | WikiText-2 ppl | x dense | conversion (s) |\n|---|---|---|---|")
    for row in rows:
        conv = "-" if row["convert_s"] is None else f"{row['convert_s']:.1f}"
        print(f"| {row['model']} | {row['ppl']:.3f} | {row['ppl'] / base:.2f}x | {conv} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

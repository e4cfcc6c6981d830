"""The README demo: dense vs CMoE perplexity of the embedded SmolLM2-135M on WikiText-2.

    python -m cmoe_jax.demo [--max-windows 8] [--configs S3A3E8,S2A2E16,S1A1E8]

After a config's name, colon-separated options choose the carving rules of that row (see
`python -m cmoe_jax.convert --help`): `rate`, `rate-energy` or `energy` (--shared-by), `reps=centroid|energy`
(--router-reps), `r=N` (--router-neurons), `fit=N` (--router-fit-tokens), `paper`
(--paper-router). Without options a row uses the conversion defaults: shared experts by
activation rate times output energy, 8 router neurons per expert chosen by output energy,
fitted score and gate scales.

Data: --data-path (the WikiText-2 test file) and --calib-path (the validation file; found
beside --data-path when left out); without them a `shared/data/wikitext-2/` folder beside
the checkout when present, otherwise WikiText-2 downloaded with `datasets` (the `datasets`
extra, which `scripts/demo.sh` installs when it finds no local copy).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from cmoe_jax.atomic_files import write_json_atomic
from cmoe_jax.cli_args import (Parser, add_calib_samples, add_data_path, add_model, add_output_json,
                               add_seed, add_seqlen, add_windows, check_writable_file, command_main)
from cmoe_jax.convert import ConvertSettings, convert
from cmoe_jax.convert import cli as convert_cli
from cmoe_jax.data import check_download, load_text_tokens, text_windows
from cmoe_jax.errors import CmoeError
from cmoe_jax.eval import perplexity
from cmoe_jax.loading import load_config, load_model, window_bos
from cmoe_jax.methods.cmoe import MoEPlan

DEFAULT_CONFIGS = "S3A3E8,S2A2E16,S1A1E8"


def local_wikitext() -> Path | None:
    for base in (Path.cwd(), Path(__file__).resolve().parents[1]):
        d = base.parent / "shared" / "data" / "wikitext-2"
        if (d / "test.txt").exists():
            return d
    return None


_FLAGS = {"reps": "--router-reps", "r": "--router-neurons", "fit": "--router-fit-tokens"}


def parse_config(spec: str) -> tuple[str, list[str]]:
    """`S3A3E8:energy:reps=energy:r=8` -> ("S3A3E8", the `cmoe-jax convert` flags it stands for)."""
    name, *opts = spec.split(":")
    flags = ["--config", name]
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not eq and key in ("rate", "rate-energy", "energy"):
            flags += ["--shared-by", key]
        elif not eq and key == "paper":
            flags.append("--paper-router")
        elif eq and key in _FLAGS:
            if key != "reps" and not value.isdigit():
                raise ValueError(f"config {spec!r}: {key}={value!r} is not a valid int")
            flags += [_FLAGS[key], value]
        else:
            raise ValueError(f"config {spec!r}: unknown option {opt!r}; use rate, rate-energy, energy, paper, "
                             f"{', '.join(k + '=...' for k in _FLAGS)}")
    return name, flags


def row_job(flags: list[str], args, calib_path: str | None,
            prog: str = "python -m cmoe_jax.demo") -> ConvertSettings:
    """The job `cmoe-jax convert` builds from the same flags: a demo row converts exactly as the CLI.

    Built by the convert command's own parser, so a default changed there changes here too.
    """
    argv = ["--model", args.model, *flags, "--calib-samples", str(args.calib_samples),
            "--seqlen", str(args.seqlen), "--seed", str(args.seed), "--out", "-"]
    if calib_path is not None:
        argv += ["--data-path", calib_path]
    return convert_cli.settings_from_args(convert_cli.parse_args(argv, prog=prog))


EXAMPLE = "{prog} --data-path wikitext-2/wiki.test.raw --max-windows 40"


def build_parser(prog: str = "python -m cmoe_jax.demo") -> Parser:
    p = Parser(prog, __doc__.split("\n")[0], EXAMPLE.format(prog=prog))
    add_model(p, what="dense model")
    data = p.add_argument_group("data", "WikiText-2: test text for perplexity, validation text for "
                                        "calibration; local files, else downloaded with `datasets` "
                                        "(the `datasets` extra)")
    add_data_path(data)
    data.add_argument("--calib-path", metavar="FILE",
                      help="local validation file for calibration (default: the validation file "
                           "beside --data-path, valid.txt or wiki.valid.raw, if present)")
    add_calib_samples(data, 8)
    add_windows(p, 8)
    add_seqlen(p, 2048)
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="comma-separated SxAyEz[:option...], one table row each")
    add_seed(p)
    add_output_json(p, "the table")
    return p


def parse_args(argv=None, prog: str = "python -m cmoe_jax.demo"):
    p = build_parser(prog)
    args = p.parse_args(argv)
    try:  # every row's plan and options are checked before the first (minutes-long) evaluation
        args.rows = [(c, *parse_config(c)) for c in args.configs.split(",") if c]
        for _, name, _ in args.rows:
            MoEPlan.parse(name)
    except ValueError as e:
        p.error(f"--configs: {e}")
    for _, _, flags in args.rows:  # the convert parser checks each row's flags: one line, exit 2
        row_job(flags, args, None, prog)
    return args


def data_files(args) -> tuple[str | None, str | None]:
    """(test file, validation file): the flags, the files beside --data-path, or a local copy."""
    test, valid = args.data_path, args.calib_path
    if test:
        if not Path(test).is_file():
            raise CmoeError(f"--data-path {test} is not a file: give the WikiText-2 test text")
        if valid is None:
            here = Path(test)
            beside = [here.with_name(here.name.replace("test", n)) for n in ("valid", "validation")]
            valid = next((str(b) for b in beside if b != here and b.is_file()), None)
    elif valid is None:
        found = local_wikitext()
        if found:
            test, valid = str(found / "test.txt"), str(found / "valid.txt")
    if valid is not None and not Path(valid).is_file():
        raise CmoeError(f"--calib-path {valid} is not a file: give the WikiText-2 validation text")
    return test, valid


def run(args) -> list[dict]:
    check_writable_file(args.out, "--out")
    test_path, valid_path = data_files(args)
    if test_path is None or valid_path is None:
        check_download("wikitext2")  # no download library: one line, before the model loads

    load_config(args.model)  # a missing or unsupported model fails here, in one line
    print(f"data: test {test_path or 'WikiText-2 via datasets'}, calibration "
          f"{valid_path or 'WikiText-2 via datasets'}")
    dense = load_model(args.model, progress=False)
    tokens = load_text_tokens("wikitext2", dense.tokenizer, split="test", data_path=test_path)
    windows = text_windows(tokens, args.seqlen, max_windows=args.max_windows,
                           bos=window_bos(dense.config, dense.tokenizer))
    rows = []
    r = perplexity(dense.model, windows)
    rows.append({"model": "dense", "ppl": r["ppl"], "convert_s": None, "tokens_per_s": r["tokens_per_s"]})
    print(f"dense perplexity on {len(windows)} x {args.seqlen} tokens: {r['ppl']:.3f}")
    del dense
    with tempfile.TemporaryDirectory() as tmp:
        for row, (spec, name, flags) in enumerate(args.rows):
            out = Path(tmp) / f"{row}_{name}"  # rows may share a plan with other options
            job = row_job(flags, args, valid_path)
            manifest = convert(args.model, job, out=out, progress=False)
            seconds = manifest["seconds"]["convert"]
            moe = load_model(str(out), progress=False)
            r = perplexity(moe.model, windows)
            rows.append({"model": spec, "ppl": r["ppl"], "convert_s": seconds,
                         "tokens_per_s": r["tokens_per_s"]})
            print(f"{spec}: perplexity {r['ppl']:.3f} (conversion {seconds:.1f} s)")
    return rows


def report(args, rows: list[dict]) -> None:
    base = rows[0]["ppl"]
    print("\n| model | WikiText-2 ppl | x dense | conversion (s) |\n|---|---|---|---|")
    for row in rows:
        conv = "-" if row["convert_s"] is None else f"{row['convert_s']:.1f}"
        print(f"| {row['model']} | {row['ppl']:.3f} | {row['ppl'] / base:.2f}x | {conv} |")
    if args.out:
        write_json_atomic(Path(args.out).expanduser(), rows)


def main(argv=None, prog: str = "python -m cmoe_jax.demo") -> int:
    return command_main(parse_args, run, report, argv, prog)


if __name__ == "__main__":
    raise SystemExit(main())

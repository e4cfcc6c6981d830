"""The argument groups every command line shares, defined once so a concept has one flag.

Each `add_*` function adds one group (model, data, windows, seqlen, seed, output,
overwrite/resume, progress) to a `Parser`; a command passes only its own defaults. `Parser`
prints an argparse error as one `error:` line plus a hint and exits 2, shows defaults in
`--help`, and records which flags were given explicitly (`args.given`), so a command can
reject a flag that does not apply to the chosen method.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

from cmoe_jax.errors import EXIT_BAD_INPUT, CmoeError, run_job

_UNSET = object()
DATASETS = ("wikitext2", "c4")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help of every flag that has one; the epilog's examples kept as written."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS) or action.required:
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """ArgumentParser with one-line errors (exit 2) and a record of the flags given."""

    def __init__(self, prog: str, description: str, example: str, **kwargs):
        super().__init__(prog=prog, description=description, formatter_class=_Formatter,
                         epilog=f"example:\n  {example}", **kwargs)

    def error(self, message: str):
        message = " ".join(message.split())
        named = re.match(r"argument (-[^/: ]+)(?:/[^:]*)?: (.*)", message)
        if named:  # "argument --seqlen/--x: must be ..." -> "--seqlen must be ..."
            message = f"{named[1]}{' ' if named[2].startswith('must') else ': '}{named[2]}"
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)

    def parse_args(self, args=None, namespace=None):
        """Parse, then set `given`: the destinations of the flags that were on the command line."""
        argv = sys.argv[1:] if args is None else list(args)
        appends = {a.dest for a in self._actions if isinstance(a, argparse._AppendAction)}
        probe = argparse.Namespace(**{a.dest: [] if a.dest in appends else _UNSET
                                      for a in self._actions if a.dest != argparse.SUPPRESS})
        probe = super().parse_args(argv, probe)
        given = {dest for dest, value in vars(probe).items()
                 if value is not _UNSET and not (dest in appends and value == [])}
        result = super().parse_args(argv, namespace)
        result.given = given
        return result

    def flag(self, dest: str) -> str:
        """The first spelling of the option stored in `dest` (for messages)."""
        return next(a.option_strings[0] for a in self._actions if a.dest == dest and a.option_strings)

    def reject(self, args, dests, reason: str) -> None:
        """A one-line error when any of `dests` was given explicitly (it does not apply)."""
        bad = [self.flag(d) for d in dests if d in args.given]
        if bad:
            self.error(f"{', '.join(bad)} {'does' if len(bad) == 1 else 'do'} not apply {reason}")


def parse_or_code(parse, argv, prog: str):
    """`(parse(argv, prog), None)`, or `(None, exit code)` after --help or a usage error.

    The commands' `main()` returns its exit code instead of raising SystemExit.
    """
    try:
        return parse(argv, prog), None
    except SystemExit as e:
        return None, e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_BAD_INPUT)


def command_main(parse, run, report, argv, prog: str) -> int:
    """What every command's `main()` does: parse (a usage error is one line, exit 2), run the job
    (bad input is one line, exit 2), then `report(args, result)` prints the command's summary.
    Returns the exit code instead of raising SystemExit."""
    args, code = parse_or_code(parse, argv, prog)
    if args is None:
        return code
    result, code = run_job(run, args)
    if code:
        return code
    if report is not None:
        report(args, result)
    return 0


# The largest value of each kind of number, from what the value ends up in.
INT64_MAX = 2**63 - 1  # counts (windows, samples, tokens, experts, ranks) index numpy's int64 arrays
STEP_MAX = 2**31 - 1  # JAX, 64-bit types off, counts optimiser and loop steps in int32
SEED_MAX = 2**32 - 1  # JAX's keys (64-bit types off) keep a seed's low 32 bits: 2**32 would repeat seed 0
MIB_MAX = INT64_MAX // 2**20  # a size in MiB whose bytes fit an int64
FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max: losses are float32


def number_type(kind, low: float, inclusive: bool, what: str, high: float | None = None, why: str = ""):
    """An argparse type: a `kind` number from `low` up to `high` (`why`: what bounds it)."""
    def check(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}")
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high} ({why}), got {text}")
        return value
    check.__name__ = kind.__name__
    return check


_COUNT = (INT64_MAX, "a 64-bit integer")
positive_int = number_type(int, 1, True, "at least 1", *_COUNT)
nonneg_int = number_type(int, 0, True, "at least 0", *_COUNT)


_STEPS = (STEP_MAX, "JAX counts steps in 32-bit integers")
step_count = number_type(int, 1, True, "at least 1", *_STEPS)
nonneg_steps = number_type(int, 0, True, "at least 0", *_STEPS)
seed_int = number_type(int, 0, True, "at least 0", SEED_MAX, "JAX's random keys take 32 bits of a seed")
mib_size = number_type(float, 0.0, False, "above 0", MIB_MAX, "its bytes must fit a 64-bit integer")
positive_float = number_type(float, 0.0, False, "above 0")
nonneg_float = number_type(float, 0.0, True, "at least 0")


def share(text: str) -> float:
    """A share from 0 (included) to 1 (excluded)."""
    value = nonneg_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, got {text}")
    return value


seqlen_int = number_type(int, 2, True, "at least 2 (a window predicts tokens[1:])", *_COUNT)


def add_model(p: Parser, default: str | None = "smollm2", what: str = "model") -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=default, required=default is None,
                   help=f"{what}: a converted or fine-tuned cmoe_jax directory, a Hugging Face directory "
                        "or Hub id, a .gguf file, or 'smollm2' (the embedded SmolLM2-135M-Instruct)")


def add_data(p: Parser, split: str | None, purpose: str, datasets=DATASETS) -> argparse._ArgumentGroup:
    """--dataset (alias --calib), --split (alias --calib-split), --data-path."""
    g = p.add_argument_group("data", f"text for {purpose}: a local file (--data-path), otherwise "
                                     "downloaded with the `datasets` library (the `datasets` extra)")
    g.add_argument("--dataset", "--calib", dest="dataset", default=datasets[0], choices=datasets,
                   help="text corpus")
    g.add_argument("--split", "--calib-split", dest="split", default=split,
                   help="dataset split" + ("" if split else " (default: test for wikitext2, validation for c4)"))
    add_data_path(g)
    return g


def add_data_path(g, required: bool = False) -> None:
    g.add_argument("--data-path", required=required, metavar="FILE",
                   help="local text file instead of downloading (WikiText-2: a raw release file "
                        "such as wiki.valid.raw; C4: JSON lines)")


def add_calib_samples(g, default: int, zero_ok: bool = False) -> None:
    g.add_argument("--calib-samples", type=nonneg_int if zero_ok else positive_int, default=default,
                   metavar="N", help="calibration windows of --seqlen tokens"
                                     + (" (0: none)" if zero_ok else ""))


def add_calib_bos(g) -> None:
    g.add_argument("--calib-bos", action="store_true",
                   help="open every calibration window with BOS, as the model's evaluation windows "
                        "open (families that read each window as a document: Gemma 3)")


def add_windows(p: Parser, default: int | None = None, limit: bool = False) -> None:
    """--max-windows (alias --windows); with `limit`, --limit for question sets."""
    g = p.add_argument_group("windows")
    g.add_argument("--max-windows", "--windows", dest="max_windows", type=positive_int, default=default,
                   metavar="N", help="evaluate only the first N windows of --seqlen tokens"
                                     + ("" if default else " (default: all)"))
    if limit:
        g.add_argument("--limit", type=positive_int, default=None, metavar="N",
                       help="--task: score only the first N questions (default: all)")


def add_seqlen(p: Parser, default: int, what: str = "tokens per window") -> None:
    p.add_argument("--seqlen", type=seqlen_int, default=default, metavar="T", help=what)


def add_seed(p: Parser) -> None:
    p.add_argument("--seed", type=seed_int, default=0, help="random seed (data sampling, initialisation)")


def add_output_dir(p: Parser, what: str, resume: str | None = "continue an interrupted run in OUT.partial",
                   report: bool = False) -> None:
    """--out DIR (required), --overwrite, --resume where the job resumes, --report where it
    draws one."""
    g = p.add_argument_group("output")
    g.add_argument("--out", required=True, metavar="DIR", type=out_path, help=f"output directory: {what}")
    g.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    if resume:
        g.add_argument("--resume", action="store_true", help=resume)
    if report:
        g.add_argument("--report", action="store_true", help="write PNG plots and report.json")


def add_output_json(p: Parser, what: str = "the result") -> None:
    """--out FILE, with --json and lm-eval's --output-path as aliases."""
    g = p.add_argument_group("output")
    g.add_argument("--out", "--json", "--output-path", dest="out", metavar="FILE", type=out_path,
                   help=f"write {what} as JSON to this file")


def add_progress(p: Parser) -> None:
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def out_path(text: str) -> str:
    """An output path as given, `~` expanded (the same path is checked and written)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a path, got an empty string")
    try:
        text.encode("utf-8")  # a name the shell passed as bytes that are not UTF-8
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"{ascii(text)} is not valid UTF-8: the path is recorded in "
                                         "the output's files; choose a name of UTF-8 characters") from None
    return os.path.expanduser(text)


def check_readable_file(path: str, flag: str) -> None:
    """Fail before any work when the input file `path` is missing or not a file."""
    target = Path(path).expanduser()
    if not target.exists():
        raise CmoeError(f"{flag} {target} does not exist: give an existing file")
    if not target.is_file():
        raise CmoeError(f"{flag} {target} is a {'directory' if target.is_dir() else 'special file'}: "
                        "give the file itself")


def check_writable_file(path: str | None, flag: str) -> None:
    """Fail before any work when `path` cannot be written: its directory missing, or a
    trial open refused (a read-only or special filesystem such as /proc). A file the trial
    creates is removed at once."""
    if not path:
        return
    target = Path(path).expanduser()
    if target.is_dir():
        raise CmoeError(f"{flag} {path} is a directory: give a file name")
    parent = target.resolve().parent
    if not parent.is_dir():
        raise CmoeError(f"{flag}: directory {parent} does not exist: create it first")
    existed = target.exists()
    try:
        fd = os.open(target, os.O_WRONLY | os.O_APPEND | (0 if existed else os.O_CREAT | os.O_EXCL), 0o644)
        os.close(fd)
        if not existed:
            target.unlink()
    except OSError as e:
        raise CmoeError(f"{flag} {path} cannot be written ({e.strerror}): choose another path") from None


def check_writable_dir(path: str, flag: str = "--out") -> None:
    """Fail before any work when directory `path` (and its `.partial` sibling) cannot be created
    (that it lies apart from the job's inputs is the job layer's check: `jobs.apart`)."""
    target = Path(path).expanduser()
    if target.exists() and not target.is_dir():
        raise CmoeError(f"{flag} {path} is a file: give a directory")
    here = Path.cwd().resolve()
    if not target.name or target.resolve() in (here, *here.parents) or target.name in (".", ".."):
        raise CmoeError(f"{flag} {path!r} names the working directory or one above it: give a new "
                        "directory for the output (a job replaces its whole --out)")
    parent = target.resolve().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise CmoeError(f"{flag} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CmoeError(f"{flag} {path}: directory {parent} is not writable: choose another path")

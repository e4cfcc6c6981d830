"""`cmoe-jax`: one console command; each subcommand is a `python -m cmoe_jax.<module>` CLI.

    cmoe-jax convert --model smollm2 --config S1A1E8 --out out/s1a1e8
    cmoe-jax eval --model out/s1a1e8 --max-windows 40

A subcommand's module is imported only when it runs, so `cmoe-jax --help` is instant and a
subcommand whose optional dependency is missing (lmeval) fails alone, in one line.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys

from cmoe_jax.errors import EXIT_BAD_INPUT, CmoeError

# name -> (module with main(argv), one-line summary)
COMMANDS = {
    "convert": ("cmoe_jax.convert.cli", "dense model -> MoE (CMoE, hierarchical CMoE, ExpertWeaver)"),
    "eval": ("cmoe_jax.eval.cli", "perplexity (WikiText-2, C4) or zero-shot accuracy (ARC)"),
    "train": ("cmoe_jax.train.cli", "LoRA fine-tuning of a dense or converted model"),
    "compress": ("cmoe_jax.compress.cli", "shrink an MoE's expert pool (ConMoE or a baseline)"),
    "export": ("cmoe_jax.export.cli", "write a Hugging Face directory transformers can load"),
    "downcycle": ("cmoe_jax.downcycle.cli", "weave a dense model into an MoE and train all of it"),
    "demo": ("cmoe_jax.demo", "dense vs CMoE perplexity of the embedded SmolLM2-135M"),
    "generate": ("cmoe_jax.generate.cli", "generate text with a dense or converted model"),
    "lmeval": ("cmoe_jax.eval.lmeval", "lm-evaluation-harness with the cmoe_jax backend (extra: lmeval)"),
}


def available() -> dict[str, tuple[str, str]]:
    """The subcommands whose module exists in this installation."""
    return {name: entry for name, entry in COMMANDS.items() if _exists(entry[0])}


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {summary}" for name, (_, summary) in available().items())
    return ("usage: cmoe-jax COMMAND [flags]   (cmoe-jax COMMAND --help: that command's flags)\n\n"
            f"commands:\n{rows}\n\nexample:\n  cmoe-jax convert --model smollm2 --config S1A1E8 --out out/s1a1e8")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    commands = available()
    if name not in commands:
        print(f"error: unknown command {name!r}: use one of {', '.join(commands)} (see cmoe-jax --help)",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        run = importlib.import_module(commands[name][0]).main
    except CmoeError as e:  # an optional dependency of this subcommand is missing
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if "prog" in inspect.signature(run).parameters:
        code = run(rest, prog=f"cmoe-jax {name}")
    else:
        code = run(rest)
    return code or 0


if __name__ == "__main__":
    sys.exit(main())

"""Every command in README.md and docs/ parses with its command's own parser.

Commands are read from fenced ```bash blocks: line continuations joined, comments and
`VAR=value` prefixes dropped, shell variables replaced by a placeholder value. A line that
runs `python -m cmoe_jax.X` or `cmoe-jax X` is parsed (not run) with that CLI's parser, so
a flag the code does not have, or a value it refuses, fails here instead of in a reader's
terminal.
"""
from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from cmoe_jax.commands import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MODULES = {m.removesuffix(".cli"): m for m, _ in COMMANDS.values()}  # python -m target -> parser module
_PREFIX = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)+")


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)


def command_lines(block: str) -> list[str]:
    """The block's commands: continuations joined, comments and env prefixes dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        line = _PREFIX.sub("", " ".join(line.split()))
        if line:
            lines.append(line)
    return lines


def cli_call(line: str):
    """(module, argv) of a `python -m cmoe_jax.X` / `cmoe-jax X` line, else None."""
    words = shlex.split(re.sub(r"\$\{?\w+\}?", "VALUE", line))
    for i, word in enumerate(words):
        if word == "-m" and i + 1 < len(words) and words[i + 1] in MODULES:
            return MODULES[words[i + 1]], words[i + 2:]
        if word == "cmoe-jax" and i + 1 < len(words) and not words[i + 1].startswith("-"):
            name = words[i + 1]
            return (COMMANDS[name][0] if name in COMMANDS else name), words[i + 2:]
    return None


def documented_calls():
    calls = []
    for path in DOCS:
        for block in bash_blocks(path.read_text()):
            for line in command_lines(block):
                call = cli_call(line)
                if call:
                    calls.append(pytest.param(*call, id=f"{path.relative_to(ROOT)}: {line[:60]}"))
    return calls


def test_the_docs_have_commands():
    assert len(documented_calls()) >= 10


@pytest.mark.parametrize("module, argv", documented_calls())
def test_documented_command_parses(module, argv, capsys):
    assert module in {m for m, _ in COMMANDS.values()}, f"no such command: {module}"
    cli = importlib.import_module(module)
    try:
        cli.parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{module} {' '.join(argv)}: exit {e.code}: {capsys.readouterr().err.strip()}")


def test_extraction_handles_continuations_prefixes_and_comments():
    block = ("# a comment\nVENV=.venv-x OUT=a python -m cmoe_jax.eval --model smollm2 \\\n"
             "    --max-windows 4   # trailing comment\ncmoe-jax convert --config S1A1E8 --out \"$OUT\"\n")
    lines = command_lines(block)
    assert lines == ["python -m cmoe_jax.eval --model smollm2 --max-windows 4",
                     'cmoe-jax convert --config S1A1E8 --out "$OUT"']
    assert cli_call(lines[0]) == ("cmoe_jax.eval.cli", ["--model", "smollm2", "--max-windows", "4"])
    assert cli_call(lines[1]) == ("cmoe_jax.convert.cli", ["--config", "S1A1E8", "--out", "VALUE"])

"""Regenerate the bad-input table of docs/guides/outputs.md from the tests.

    python scripts/bad_input_table.py

Runs `tests/test_bad_input.py::test_bad_input_is_one_line_exit_2_nothing_written` and the
parser property test of `tests/test_cli_limits.py` with `CMOE_BAD_INPUT_TABLE` set: every
end-to-end case that passes (one `error:` line, exit 2, nothing written) records its flags
and its line; each command's parser test records the distinct (flag, value) pairs it refused
in one line. The table between the markers of the guide is rewritten from those records,
with the parser cases counted per command and the total. A case that fails is not counted
and the script exits 1.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "outputs.md"
BEGIN, END = "<!-- bad-input-table: begin -->", "<!-- bad-input-table: end -->"
PLACEHOLDERS = {"EXISTS": "(OUT exists)", "LOCKED": "(OUT locked by another job)",
                "FOREIGN_PARTIAL": "(OUT.partial not made by a job)", "STAGED": "(OUT.partial staged)",
                "UNDER_FILE": "(--out under a file)", "NONE": "(a missing file)",
                "LOCK_SYMLINK": "(OUT.lock a symbolic link)", "PROMPTS_LATIN1": "--prompts-file (Latin-1 text)"}


def _flags(flags: list[str]) -> str:
    shown = []
    for f in flags:
        if f.startswith("OUT="):
            value = f[4:]
            shown.append("--out (the source's directory)" if value == "SOURCE_PARENT" else f"--out {value!r}")
        else:
            shown.append(PLACEHOLDERS.get(f, f))
    shown = " ".join(shown).encode("utf-8", "backslashreplace").decode()  # a name that is not UTF-8
    return shown.replace("|", "\\|") or "(the case's model)"


TESTS = ["tests/test_bad_input.py::test_bad_input_is_one_line_exit_2_nothing_written",
         "tests/test_cli_limits.py::test_every_numeric_flag_at_the_type_limits_is_exit_0_or_2"]


def table(records: list[dict]) -> str:
    cases = [r for r in records if "id" in r]
    parsers = {r["parser"]: len(r["cases"]) for r in records if "parser" in r}
    rows = ["| case | command | its one line | written |", "|---|---|---|---|"]
    for r in cases:
        line = re.sub(r"\(pid \d+ on [^:]+: .*\): wait", "(pid PID on HOST: COMMAND): wait", r["error"])
        line = line.replace("|", "\\|")
        rows.append(f"| {r['id']} | `{r['job']}` {_flags(r['flags'])} | `{line}` | nothing |")
    counts = ", ".join(f"{job} {n}" for job, n in sorted(parsers.items()))
    rows += ["", f"Besides these {len(cases)} cases, the parsers alone refuse {sum(parsers.values())} distinct "
                 f"(flag, value) pairs at and beyond the limits of each numeric flag's type ({counts}), "
                 f"each in one line: {len(cases) + sum(parsers.values())} bad inputs, 0 tracebacks."]
    return "\n".join(rows)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        records_file = Path(tmp) / "records.jsonl"
        env = dict(os.environ, CMOE_BAD_INPUT_TABLE=str(records_file), PYTHONPATH=str(ROOT),
                   JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
                              cwd=ROOT, env=env)
        records = [json.loads(line) for line in records_file.read_text().splitlines()] \
            if records_file.exists() else []
    text = GUIDE.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    # encoded before the file is opened: a failure leaves the guide as it was, not emptied
    GUIDE.write_bytes((text[:start] + "\n" + table(records) + "\n" + text[end:]).encode())
    print(table(records).splitlines()[-1], f"({GUIDE.relative_to(ROOT)} rewritten)")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())

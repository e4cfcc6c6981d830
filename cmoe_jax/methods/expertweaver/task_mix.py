"""Task-diverse calibration (`--calib-mix diverse`): pseudo-tasks of different formats.

ExpertWeaver's CV rule needs tasks whose activations differ; the paper calibrates on Flan-v2
(42-48 instruction tasks), which is not available offline. WikiText articles differ only in
topic, so here the tasks are built from local material in seven formats: prose (WikiText
articles), ARC questions alone, ARC question + answer, lettered multiple choice, structured
records (JSON lines / CSV / markdown tables of ARC records), Python source (fixed stdlib
modules read from disk) and arithmetic (generated with a seeded numpy RNG). `tasks` are
spread evenly over the formats (42 = 6 per format by default), each task one text from which
`task_windows` cuts `samples_per_task` windows.
"""
from __future__ import annotations

import ast
import csv
import io
import itertools
import json
import sysconfig
from pathlib import Path

import numpy as np

from cmoe_jax.data.text_sources import DataError, _check_file
from cmoe_jax.methods.expertweaver.calib_tasks import task_windows, wikitext_articles

FORMATS = ("prose", "arc-question", "arc-qa", "multiple-choice", "structured", "code", "arithmetic")
ARC_FORMATS = ("arc-question", "arc-qa", "multiple-choice", "structured")
# stdlib modules (pure Python in every CPython >= 3.11), sorted; code task t reads the t-th
CODE_MODULES = ("bisect", "calendar", "colorsys", "copy", "dataclasses", "difflib", "fnmatch",
                "fractions", "glob", "graphlib", "heapq", "numbers", "queue", "sched", "shlex",
                "statistics", "string", "textwrap")
ARITHMETIC = ("addition", "subtraction", "multiplication", "long multiplication", "division",
              "bracketed")
STRUCTURED = ("JSON lines", "CSV", "markdown table")
LETTERS = "ABCDEFGH"


def format_counts(tasks: int) -> dict[str, int]:
    """Tasks per format: `tasks` spread evenly, the earlier formats taking the remainder."""
    n = len(FORMATS)
    return {f: tasks // n + (i < tasks % n) for i, f in enumerate(FORMATS) if tasks // n + (i < tasks % n)}


def arc_records(path) -> list[dict]:
    """ARC JSON lines (`question`, `choices` {text, label}, `answerKey`), in file order."""
    path = Path(path)
    _check_file(path)
    records = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
                q["choices"]["label"].index(q["answerKey"]), q["question"], q["choices"]["text"]
            except (ValueError, KeyError, TypeError, AttributeError):
                raise DataError(f"{path} line {lineno} is not an ARC record (question, choices with "
                                "text and label, answerKey among the labels)") from None
            records.append(q)
    return records


def _answer(q: dict) -> tuple[str, str]:
    """(letter, text) of the correct choice; numeric labels 1-4 become letters A-D."""
    i = q["choices"]["label"].index(q["answerKey"])
    return LETTERS[i], q["choices"]["text"][i]


def question_text(records) -> str:
    return "\n".join(q["question"] for q in records)


def qa_text(records) -> str:
    return "\n\n".join(f"Question: {q['question']}\nAnswer: {_answer(q)[1]}" for q in records)


def multiple_choice_text(records) -> str:
    """Question, the choices as `A. ...` lines, then `Answer: X` (X the correct choice's letter)."""
    blocks = []
    for q in records:
        options = "\n".join(f"{LETTERS[i]}. {t}" for i, t in enumerate(q["choices"]["text"]))
        blocks.append(f"Question: {q['question']}\n{options}\nAnswer: {_answer(q)[0]}")
    return "\n\n".join(blocks)


def structured_text(records, kind: int) -> str:
    """ARC records as JSON lines (kind 0), CSV (1) or a markdown table (2)."""
    rows = [(q.get("id", str(i)), q["question"], *_answer(q)) for i, q in enumerate(records)]
    if kind % 3 == 0:
        return "\n".join(json.dumps({"id": r[0], "question": r[1], "choices": q["choices"]["text"],
                                     "answer": r[2]}) for r, q in zip(rows, records))
    if kind % 3 == 1:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["id", "question", "answer", "answer_text"])
        writer.writerows(rows)
        return buf.getvalue()
    cell = [[str(c).replace("|", "\\|") for c in r] for r in rows]
    return "\n".join(["| id | question | answer | answer text |", "|---|---|---|---|",
                      *("| " + " | ".join(r) + " |" for r in cell)])


def code_text(module: str) -> str:
    """The source of a stdlib module, its module docstring dropped (code, not prose)."""
    source = (Path(sysconfig.get_paths()["stdlib"]) / f"{module}.py").read_text()
    tree = ast.parse(source)
    if len(tree.body) > 1 and ast.get_docstring(tree) is not None:
        first = tree.body[1]
        start = min([first.lineno] + [d.lineno for d in getattr(first, "decorator_list", [])])
        return "\n".join(source.splitlines()[start - 1:])
    return source


def _exercise(kind: int, rng: np.random.Generator) -> str:
    """One exercise of `ARITHMETIC[kind]`, its operands drawn from `rng`."""
    if kind == 0:
        a, b = rng.integers(10, 100, 2)
        return f"{a} + {b} = {a + b}"
    if kind == 1:
        a, b = rng.integers(100, 1000, 2)
        return f"{a} - {b} = {a - b}"
    if kind in (2, 3):  # one- or three-digit multiplier
        a, b = (rng.integers(10, 100), rng.integers(2, 10)) if kind == 2 else rng.integers(100, 1000, 2)
        return f"{a} * {b} = {a * b}"
    if kind == 4:
        a, b = rng.integers(100, 1000), rng.integers(2, 20)
        return f"{a} / {b} = {a // b} remainder {a % b}"
    a, b, c = rng.integers(1, 50, 3)
    return f"({a} + {b}) * {c} = {(a + b) * c}"


def arithmetic_text(kind: int, rng: np.random.Generator, lines: int = 400) -> str:
    """`lines` exercises of one kind (`ARITHMETIC[kind % 6]`), e.g. `12 + 35 = 47`."""
    kind %= len(ARITHMETIC)
    return "\n".join(_exercise(kind, rng) for _ in range(lines))


def _render(fmt: str, records: list, t: int) -> str:
    if fmt == "arc-question":
        return question_text(records)
    if fmt == "arc-qa":
        return qa_text(records)
    if fmt == "multiple-choice":
        return multiple_choice_text(records)
    return structured_text(records, t)


def _chunks(items: list, count: int) -> list[tuple[int, list]]:
    """`count` contiguous equal chunks of `items` (the remainder dropped), with start indices."""
    size = len(items) // count
    return [(t * size, items[t * size:(t + 1) * size]) for t in range(count)]


def pseudo_tasks(wikitext_path, arc_path, tasks: int = 42, seed: int = 0) -> dict[str, list]:
    """Candidate (name, text) pairs per format, in order: `tasks` spread over the formats;
    prose offers every article (the first long enough are taken), the others exactly their count."""
    counts = format_counts(tasks)
    out: dict[str, list] = {}
    if "prose" in counts:
        out["prose"] = [(f"prose: {a.splitlines()[0].strip(' =')}", a) for a in wikitext_articles(wikitext_path)]
    arc = [f for f in ARC_FORMATS if f in counts]
    if arc:
        records = arc_records(arc_path)
        part = len(records) // len(arc)
        for j, fmt in enumerate(arc):
            mine = records[j * part:(j + 1) * part]
            out[fmt] = [(f"{fmt} {t}: ARC questions {j * part + s}-{j * part + s + len(c) - 1}"
                         + (f" as {STRUCTURED[t % 3]}" if fmt == "structured" else ""), _render(fmt, c, t))
                        for t, (s, c) in enumerate(_chunks(mine, counts[fmt]))]
    if "code" in counts:
        if counts["code"] > len(CODE_MODULES):
            raise DataError(f"--calib-mix diverse: at most {len(CODE_MODULES)} code tasks "
                            f"({counts['code']} asked): lower --calib-tasks")
        out["code"] = [(f"code: {m}.py", code_text(m)) for m in CODE_MODULES]
    if "arithmetic" in counts:
        rng = np.random.default_rng(seed)
        out["arithmetic"] = [(f"arithmetic {t}: {ARITHMETIC[t % len(ARITHMETIC)]}", arithmetic_text(t, rng))
                             for t in range(counts["arithmetic"])]
    return out


def diverse_task_windows(tokenizer, wikitext_path, arc_path, tasks: int, samples_per_task: int,
                         seqlen: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(windows [N, seqlen], task ids [N], task names): per format, its first texts with
    `samples_per_task` x `seqlen` tokens, as many as `format_counts(tasks)` gives it."""
    if tasks < 2:
        raise DataError(f"--calib-mix diverse needs at least 2 tasks (got {tasks})")
    need = samples_per_task * seqlen
    chosen: list[tuple[str, str]] = []
    counts = format_counts(tasks)
    for fmt, candidates in pseudo_tasks(wikitext_path, arc_path, tasks, seed).items():
        long = list(itertools.islice(((n, t) for n, t in candidates if len(tokenizer.encode(t)) >= need),
                                     counts[fmt]))
        if len(long) < counts[fmt]:
            raise DataError(f"--calib-mix diverse: only {len(long)} of {counts[fmt]} {fmt} tasks have "
                            f"{need} tokens ({samples_per_task} x {seqlen}): lower --samples-per-task, "
                            "--seqlen or --calib-tasks")
        chosen += long
    windows, ids = task_windows([t for _, t in chosen], tokenizer, samples_per_task, seqlen, len(chosen))
    return windows, ids, [n for n, _ in chosen]

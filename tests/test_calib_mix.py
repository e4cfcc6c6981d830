"""ExpertWeaver's task-diverse calibration (`--calib-mix diverse`) against direct recomputation."""
from __future__ import annotations

import ast
import csv
import io
import json
import re
import sysconfig
import zlib
from pathlib import Path

import numpy as np
import pytest

from cmoe_jax.convert.cli import main as convert_main
from cmoe_jax.data.text_sources import DataError
from cmoe_jax.methods.expertweaver import FORMATS, diverse_task_windows, format_counts, pseudo_tasks
from cmoe_jax.methods.expertweaver.task_mix import (ARITHMETIC, arc_records, arithmetic_text, code_text,
                                                    multiple_choice_text, structured_text)


class WordTokenizer:
    """Whitespace words -> stable ids (a stand-in with the `encode` the calibration uses)."""

    def encode(self, text):
        return [zlib.crc32(w.encode()) % 1000 for w in text.split()]


def _wiki(path, n=8, words=400, seed=0):
    """WikiText-like articles (` = title = ` lines), each drawing on its own part of the vocabulary."""
    from tests.conftest import WORDS

    rng = np.random.default_rng(seed)
    lines = []
    for a in range(n):
        pool = [WORDS[(a * 11 + i) % len(WORDS)] for i in range(30)]
        body = [pool[i] for i in rng.integers(0, len(pool), words)]
        lines += ["", f" = w{a} title = ", "", *(" " + " ".join(body[i:i + 20]) + " " for i in range(0, words, 20))]
    path.write_text("\n".join(lines) + "\n")
    return path


def _arc(path, n=240, seed=0):
    """Synthetic ARC-Easy JSON lines: letter labels, every 5th record numeric labels 1-4,
    every 7th three choices and every 11th five."""
    from tests.conftest import WORDS

    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            k = 3 if i % 7 == 3 else 5 if i % 11 == 5 else 4
            labels = list("1234"[:k]) if i % 5 == 0 and k <= 4 else list("ABCDE"[:k])
            words = lambda m: " ".join(WORDS[j] for j in rng.integers(0, len(WORDS), m))  # noqa: E731
            f.write(json.dumps({"id": f"q{i}", "question": words(12) + "?",
                                "choices": {"text": [words(3) for _ in labels], "label": labels},
                                "answerKey": labels[int(rng.integers(0, k))]}) + "\n")
    return path


@pytest.fixture
def data(tmp_path):
    return _wiki(tmp_path / "wiki.txt"), _arc(tmp_path / "arc.jsonl")


def test_format_counts_spread_tasks_evenly():
    assert format_counts(42) == {f: 6 for f in FORMATS}
    ten = format_counts(10)
    assert sum(ten.values()) == 10 and list(ten.values()) == [2, 2, 2, 1, 1, 1, 1]
    assert list(format_counts(3)) == list(FORMATS[:3])


@pytest.mark.parametrize("tasks, spt, seqlen", [(14, 2, 16), (42, 2, 16), (9, 3, 8)])
def test_windows_match_direct_recomputation(data, tasks, spt, seqlen):
    wiki, arc = data
    tok = WordTokenizer()
    windows, ids, names = diverse_task_windows(tok, wiki, arc, tasks, spt, seqlen, seed=0)
    counts = format_counts(tasks)
    want, want_names = [], []
    for fmt, candidates in pseudo_tasks(wiki, arc, tasks, seed=0).items():
        long = [(n, t) for n, t in candidates if len(t.split()) >= spt * seqlen][:counts[fmt]]
        assert len(long) == counts[fmt]
        want += [np.asarray(tok.encode(t)[:spt * seqlen]).reshape(spt, seqlen) for _, t in long]
        want_names += [n for n, _ in long]
    assert windows.shape == (tasks * spt, seqlen) and windows.dtype == np.int32
    np.testing.assert_array_equal(windows, np.concatenate(want))
    np.testing.assert_array_equal(ids, np.repeat(np.arange(tasks), spt))  # grouped by task
    assert names == want_names and len(set(names)) == tasks
    per_format = [next(f for f in FORMATS if n.startswith(f + " ") or n.startswith(f + ":")) for n in names]
    assert per_format == [f for f, c in counts.items() for _ in range(c)]


def test_arc_formats_use_disjoint_contiguous_question_blocks(data):
    wiki, arc = data
    tasks = pseudo_tasks(wiki, arc, 42)
    records = arc_records(arc)
    part = len(records) // 4
    for j, fmt in enumerate(("arc-question", "arc-qa", "multiple-choice", "structured")):
        assert len(tasks[fmt]) == 6
        for t, (name, text) in enumerate(tasks[fmt]):
            lo, hi = j * part + t * (part // 6), j * part + (t + 1) * (part // 6) - 1
            assert f"ARC questions {lo}-{hi}" in name
            assert records[lo]["question"] in text and records[hi]["question"] in text
            assert hi + 1 == len(records) or records[hi + 1]["question"] not in text


def _check_line(line: str) -> None:
    n = r"(-?\d+)"
    for pattern, f in [(rf"^{n} \+ {n} = {n}$", lambda a, b: [a + b]),
                       (rf"^{n} - {n} = {n}$", lambda a, b: [a - b]),
                       (rf"^{n} \* {n} = {n}$", lambda a, b: [a * b]),
                       (rf"^{n} / {n} = {n} remainder {n}$", lambda a, b: [a // b, a % b]),
                       (rf"^\({n} \+ {n}\) \* {n} = {n}$", None)]:
        m = re.match(pattern, line)
        if m:
            v = [int(g) for g in m.groups()]
            if f is None:
                assert (v[0] + v[1]) * v[2] == v[3], line
            else:
                assert f(v[0], v[1]) == v[2:], line
            return
    raise AssertionError(f"unparsed line {line!r}")


def test_arithmetic_lines_are_correct(data):
    rng = np.random.default_rng(3)
    for kind in range(len(ARITHMETIC)):
        lines = arithmetic_text(kind, rng, lines=300).splitlines()
        assert len(lines) == 300
        for line in lines:
            _check_line(line)
    texts = pseudo_tasks(*data, 42)["arithmetic"]
    assert [n.split(": ")[1] for n, _ in texts] == list(ARITHMETIC)
    assert "*" in texts[3][1] and max(len(s.split(" = ")[1]) for s in texts[3][1].splitlines()) >= 5
    for _, text in texts:
        for line in text.splitlines():
            _check_line(line)


def test_multiple_choice_letter_matches_answer_key(data):
    records = arc_records(data[1])
    blocks = multiple_choice_text(records).split("\n\n")
    assert len(blocks) == len(records)
    for q, block in zip(records, blocks):
        lines = block.splitlines()
        assert lines[0] == f"Question: {q['question']}"
        texts, labels = q["choices"]["text"], q["choices"]["label"]
        assert lines[1:-1] == [f"{'ABCDE'[i]}. {t}" for i, t in enumerate(texts)]
        letter = re.fullmatch(r"Answer: ([A-E])", lines[-1])[1]
        if labels[0] == "A":
            assert letter == q["answerKey"]
        else:  # numeric labels: the letter at the answer key's position
            assert "ABCDE".index(letter) == labels.index(q["answerKey"])
        assert texts["ABCDE".index(letter)] == texts[labels.index(q["answerKey"])]


def test_structured_renderings_read_back(data):
    records = arc_records(data[1])[:20]
    key = [q["choices"]["text"][q["choices"]["label"].index(q["answerKey"])] for q in records]
    rows = [json.loads(line) for line in structured_text(records, 0).splitlines()]
    assert [r["question"] for r in rows] == [q["question"] for q in records]
    assert [r["choices"][list("ABCDE").index(r["answer"])] for r in rows] == key
    table = list(csv.reader(io.StringIO(structured_text(records, 1))))
    assert table[0] == ["id", "question", "answer", "answer_text"]
    assert [r[3] for r in table[1:]] == key and [r[1] for r in table[1:]] == [q["question"] for q in records]
    md = structured_text(records, 2).splitlines()
    assert md[0].startswith("| id |") and len(md) == 2 + len(records)
    assert all(line.count(" | ") == 3 for line in md[2:])


def test_code_tasks_are_stdlib_source_without_docstring(data):
    names = [n for n, _ in pseudo_tasks(*data, 42)["code"]]
    assert names == sorted(names) and len(names) >= 6
    for name in names[:6]:
        module = name.split(": ")[1].removesuffix(".py")
        text = code_text(module)
        source = (Path(sysconfig.get_paths()["stdlib"]) / f"{module}.py").read_text()
        assert source.rstrip("\n").endswith(text.rstrip("\n")) and len(text) > 1000
        tree = ast.parse(text)
        assert ast.get_docstring(tree) is None and tree.body


def test_deterministic_for_a_seed(data):
    tok = WordTokenizer()
    a = diverse_task_windows(tok, *data, 14, 2, 16, seed=0)
    b = diverse_task_windows(tok, *data, 14, 2, 16, seed=0)
    c = diverse_task_windows(tok, *data, 14, 2, 16, seed=1)
    np.testing.assert_array_equal(a[0], b[0])
    assert a[2] == b[2] == c[2]
    differ = {a[2][i] for i in a[1][np.any(a[0] != c[0], axis=1)]}
    assert differ and all(n.startswith("arithmetic") for n in differ)  # only the generated tasks


def test_too_short_material_fails_with_the_format_named(data):
    with pytest.raises(DataError, match="prose tasks have"):
        diverse_task_windows(WordTokenizer(), *data, 42, 2, 512)


def _cli(path, wiki, out, *extra):
    return ["--method", "expertweaver", "--model", str(path), "--data-path", str(wiki), "--experts", "8",
            "--samples-per-task", "2", "--seqlen", "32", "--out", str(out), *extra]


def test_diverse_without_arc_path_is_one_error_line(data, tmp_path, capsys):
    out = tmp_path / "out"
    assert convert_main(_cli(tmp_path / "no-model", data[0], out, "--calib-mix", "diverse")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--arc-path" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_calib_mix_is_rejected_with_cmoe(tmp_path, capsys):
    assert convert_main(["--method", "cmoe", "--config", "S1A1E8", "--calib-mix", "diverse",
                         "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --calib-mix does not apply to --method cmoe"), err


def test_cli_converts_with_diverse_calibration(tiny_checkpoint, data, tmp_path):
    import jax.numpy as jnp

    from cmoe_jax.loading import load_model

    _, path, _ = tiny_checkpoint
    out = tmp_path / "ew"
    assert convert_main(_cli(path, data[0], out, "--calib-mix", "diverse", "--arc-path", str(data[1]),
                             "--report")) == 0
    manifest = json.loads((out / "cmoe_manifest.json").read_text())
    cal = manifest["calibration"]
    assert cal["mix"] == "diverse" and len(cal["tasks"]) == 42
    assert [sum(n.startswith(f) for n in cal["tasks"]) for f in ("prose", "code", "arithmetic")] == [6, 6, 6]
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["calibration"]["mix"] == "diverse" and len(report["layers"]) == 2
    for layer, rec in zip(report["layers"], manifest["layers"]):
        assert layer["alpha"] == rec["alpha"] and layer["r"] == rec["r"] and len(layer["cv_quantiles"]) == 4
        assert layer["alpha"] == pytest.approx(0.7 - 0.5 * layer["r"])
    alphas = [rec["alpha"] for rec in manifest["layers"]]
    assert report["summary"]["alpha"]["min"] == min(alphas) and report["summary"]["alpha"]["max"] == max(alphas)
    moe = load_model(str(out), progress=False).model
    logits = moe(jnp.asarray(np.random.default_rng(0).integers(0, 92, (1, 16))))
    assert np.isfinite(np.asarray(logits)).all()

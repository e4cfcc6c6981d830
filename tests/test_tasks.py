"""`python -m cmoe_jax.eval --task`: accuracy against a transformers recomputation, bad input."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cmoe_jax.eval.cli import main as eval_main
from cmoe_jax.eval.loglikelihood import encode_pair
from cmoe_jax.eval.tasks import TASKS, mean_and_stderr, score_documents
from cmoe_jax.loading import load_tokenizer
from conftest import WORDS
from test_loglikelihood import torch_scores


def write_arc_like(path, n=12, seed=0, bad_line=None):
    """ARC-format questions over the tiny tokenizer's words; 3 to 5 choices, labels A.. or 1.."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        k = int(rng.integers(3, 6))
        labels = [str(j + 1) for j in range(k)] if i % 4 == 3 else list("ABCDE"[:k])
        doc = {"id": f"q{i}", "question": " ".join(rng.choice(WORDS, int(rng.integers(3, 15)))),
               "choices": {"text": [" ".join(rng.choice(WORDS, int(rng.integers(1, 5)))) for _ in range(k)],
                           "label": labels},
               "answerKey": labels[int(rng.integers(k))]}
        lines.append(json.dumps(doc))
    if bad_line is not None:
        lines[bad_line[0] - 1] = bad_line[1]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_task_accuracy_matches_a_transformers_recomputation(tiny_checkpoint, tmp_path, capsys):
    ref_model, path, _ = tiny_checkpoint
    data = write_arc_like(tmp_path / "arc.jsonl")
    out = tmp_path / "arc.json"
    assert eval_main(["--model", str(path), "--task", "arc_easy", "--data-path", str(data), "--limit", "10",
                      "--batch-size", "4", "--json", str(out), "--no-progress"]) == 0
    result = json.loads(out.read_text())
    assert "arc_easy: acc" in capsys.readouterr().out
    encode = load_tokenizer(path).encode
    docs = [json.loads(line) for line in data.read_text().splitlines()][:10]
    acc, acc_norm = [], []
    for i, doc in enumerate(docs):
        texts = doc["choices"]["text"]
        context = f"Question: {doc['question']}\nAnswer:"
        lls = [ll for ll, _ in torch_scores(ref_model, [encode_pair(encode, context, " " + t) for t in texts])]
        np.testing.assert_allclose(result["loglikelihoods"][i], lls, atol=1e-4)
        gold = doc["choices"]["label"].index(doc["answerKey"])
        acc.append(float(np.argmax(lls) == gold))
        acc_norm.append(float(np.argmax(np.array(lls) / [len(t) for t in texts]) == gold))
    assert result["items"] == 10 and result["requests"] == sum(len(d["choices"]["text"]) for d in docs)
    assert result["acc"] == np.mean(acc) and result["acc_norm"] == np.mean(acc_norm)
    assert math.isclose(result["acc_stderr"], np.std(acc, ddof=1) / math.sqrt(10))
    assert result["items_per_s"] > 0 and result["task"] == "arc_easy"


def test_stderr_is_lm_evals_mean_stderr():
    metrics = pytest.importorskip("lm_eval.api.metrics")
    values = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    mean, stderr = mean_and_stderr(values)
    assert mean == metrics.mean(values) and math.isclose(stderr, metrics.mean_stderr(values))


def test_acc_norm_divides_by_the_choice_length_in_characters():
    docs = [{"_choices": ["a", "bbbbbbbb"], "_gold": 1}]
    scores = score_documents(docs, [[-2.0, -8.0]])  # -2/1 < -8/8
    assert scores["acc"] == 0.0 and scores["acc_norm"] == 1.0


@pytest.mark.parametrize("case,expected", [
    ("missing", "does not exist"),
    ("malformed", ":3: not valid JSON"),
    ("unknown_task", "unknown task 'arc_hard': known tasks are arc_challenge, arc_easy"),
    ("empty_choices", ":2: empty choice list"),
    ("bad_answer", ":4: cannot build the task's context, choices or answer"),
    ("no_data_path", "needs --data-path"),
])
def test_bad_input_is_one_error_line_exit_2_nothing_written(tiny_checkpoint, tmp_path, capsys, case, expected):
    _, path, _ = tiny_checkpoint
    data, task = tmp_path / "arc.jsonl", "arc_easy"
    if case == "malformed":
        write_arc_like(data, bad_line=(3, '{"id": "q2", "question": '))
    elif case == "empty_choices":
        write_arc_like(data, bad_line=(2, json.dumps({"id": "x", "question": "w1", "answerKey": "A",
                                                      "choices": {"text": [], "label": []}})))
    elif case == "bad_answer":
        write_arc_like(data, bad_line=(4, json.dumps({"id": "x", "question": "w1", "answerKey": "Z",
                                                      "choices": {"text": ["w2"], "label": ["A"]}})))
    elif case != "missing":
        write_arc_like(data)
    task = "arc_hard" if case == "unknown_task" else task
    out = tmp_path / "out.json"
    args = ["--model", str(path), "--task", task, "--json", str(out), "--no-progress"]
    args += [] if case == "no_data_path" else ["--data-path", str(data)]
    assert eval_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert not out.exists() and not list(tmp_path.glob(".out.json*"))


def test_task_table_builds_arc_contexts_as_lm_eval():
    doc = {"question": "Why?", "choices": {"text": ["x", "y"], "label": ["A", "B"]}, "answerKey": "B"}
    task = TASKS["arc_easy"]
    assert task.context.format(**doc) == "Question: Why?\nAnswer:"
    assert task.choices(doc) == ["x", "y"] and task.gold(doc) == 1 and task.delimiter == " "

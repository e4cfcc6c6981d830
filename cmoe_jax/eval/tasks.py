"""Zero-shot multiple-choice tasks in lm-evaluation-harness conventions, defined as data.

A task is a row of `TASKS`: the JSON fields a document needs, the context template, where
its choices and gold index come from. Each choice c is scored as the continuation
`delimiter + c` of the context; `acc` picks the highest summed log-likelihood, `acc_norm`
the highest log-likelihood divided by len(c) in characters (lm-eval's `acc_norm`), and both
carry lm-eval's standard error of the mean (sample std / sqrt(n)).

Adding PIQA, BoolQ or HellaSwag is one more row once their files are at hand, e.g. PIQA:
`MultipleChoiceTask("piqa", ("goal", "sol1", "sol2", "label"), "Question: {goal}\\nAnswer:",
lambda d: [d["sol1"], d["sol2"]], lambda d: d["label"])`.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from cmoe_jax import distributed
from cmoe_jax.errors import CmoeError
from cmoe_jax.eval.loglikelihood import encode_pair, score_requests


@dataclass(frozen=True)
class MultipleChoiceTask:
    name: str
    fields: tuple[str, ...]              # JSON fields every document must have
    context: str                         # str.format template over the document's fields
    choices: Callable[[dict], list]      # document -> choice texts (without the delimiter)
    gold: Callable[[dict], int]          # document -> index of the right choice
    delimiter: str = " "                 # between context and choice (lm-eval's target_delimiter)


def _arc(name: str) -> MultipleChoiceTask:
    # lm-eval tasks/arc/arc_easy.yaml: doc_to_text "Question: {{question}}\nAnswer:",
    # doc_to_choice "{{choices.text}}", doc_to_target "{{choices.label.index(answerKey)}}"
    return MultipleChoiceTask(name, ("question", "choices", "answerKey"), "Question: {question}\nAnswer:",
                              lambda d: d["choices"]["text"],
                              lambda d: d["choices"]["label"].index(d["answerKey"]))


TASKS = {"arc_easy": _arc("arc_easy"), "arc_challenge": _arc("arc_challenge")}


def get_task(name: str) -> MultipleChoiceTask:
    if name not in TASKS:
        raise CmoeError(f"unknown task {name!r}: known tasks are {', '.join(sorted(TASKS))}")
    return TASKS[name]


def load_documents(task: MultipleChoiceTask, path, limit: int | None = None) -> list[dict]:
    """Documents of a JSON-lines file, each checked (a bad line is named by its number).

    Every line is checked, even beyond `limit`, so a broken file fails before any work.
    Each returned document carries "_context", "_choices" and "_gold".
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise CmoeError(f"--data-path {path} does not exist: give the task's JSON-lines file "
                        "(e.g. ../shared/data/arc-easy/test.jsonl)")
    docs = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                docs.append(_checked_document(task, line, f"{path}:{number}"))
    if not docs:
        raise CmoeError(f"{path} holds no documents (expected one JSON object per line)")
    return docs[:limit] if limit else docs


def _checked_document(task: MultipleChoiceTask, line: str, where: str) -> dict:
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as e:
        raise CmoeError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(doc, dict):
        raise CmoeError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    missing = [f for f in task.fields if f not in doc]
    if missing:
        raise CmoeError(f"{where}: missing field(s) {', '.join(missing)} needed by task {task.name}")
    try:
        choices = task.choices(doc)
        if isinstance(choices, list) and not choices:
            raise CmoeError(f"{where}: empty choice list (every question needs at least one choice)")
        gold, context = task.gold(doc), task.context.format(**doc)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CmoeError(f"{where}: cannot build the task's context, choices or answer "
                        f"({type(e).__name__}: {e})") from None
    if not isinstance(choices, list):
        raise CmoeError(f"{where}: the choices must be a list, got {type(choices).__name__}")
    if not all(isinstance(c, str) and c for c in choices):
        raise CmoeError(f"{where}: every choice must be a non-empty string, got {choices!r}")
    if not 0 <= gold < len(choices):
        raise CmoeError(f"{where}: answer index {gold} is outside the {len(choices)} choices")
    return {**doc, "_context": context, "_choices": choices, "_gold": gold}


def mean_and_stderr(values) -> tuple[float, float]:
    """Mean and lm-eval's `mean_stderr`: sample standard deviation (n - 1) / sqrt(n)."""
    x = np.asarray(values, np.float64)
    if len(x) < 2:
        return float(x.mean()), float("nan")
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(len(x)))


def score_documents(docs, loglikelihoods) -> dict:
    """acc, acc_norm and their standard errors from each document's per-choice log-likelihoods."""
    acc, acc_norm = [], []
    for doc, lls in zip(docs, loglikelihoods, strict=True):
        lls = np.asarray(lls, np.float64)
        lengths = np.array([len(c) for c in doc["_choices"]], np.float64)
        acc.append(float(np.argmax(lls) == doc["_gold"]))
        acc_norm.append(float(np.argmax(lls / lengths) == doc["_gold"]))
    (a, a_se), (n, n_se) = mean_and_stderr(acc), mean_and_stderr(acc_norm)
    return {"acc": a, "acc_stderr": a_se, "acc_norm": n, "acc_norm_stderr": n_se}


def task_requests(task: MultipleChoiceTask, docs, encode):
    """(context_ids, continuation_ids) for every choice of every document, document-major."""

    return [encode_pair(encode, doc["_context"], task.delimiter + choice)
            for doc in docs for choice in doc["_choices"]]


def evaluate_task(model, encode, task: MultipleChoiceTask, docs, batch_size: int = 32,
                  mesh=None, progress: bool = True) -> dict:
    """Zero-shot accuracy of `model` on checked `docs`; `encode(text) -> ids` (no special tokens)."""


    all_docs, docs = docs, distributed.split_for_process(docs)  # this process's share
    t0 = time.perf_counter()
    requests = task_requests(task, docs, encode)
    tokenize_seconds = time.perf_counter() - t0
    results, stats = score_requests(model, requests, batch_size=batch_size, mesh=mesh,
                                    progress=progress, desc=task.name)
    per_doc, k = [], 0
    for doc in docs:
        per_doc.append([ll for ll, _ in results[k:k + len(doc["_choices"])]])
        k += len(doc["_choices"])
    per_doc = [lls for part in distributed.gather_objects(per_doc) for lls in part]
    docs = all_docs
    seconds = stats.pop("seconds") + tokenize_seconds
    return {"task": task.name, "items": len(docs), **score_documents(docs, per_doc),
            "items_per_s": len(docs) / seconds, "seconds": seconds,
            "tokenize_seconds": tokenize_seconds, **stats, "loglikelihoods": per_doc}

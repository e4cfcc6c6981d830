"""Calibration samples grouped by task, for ExpertWeaver's per-task activation statistics.

The paper samples 5 few-shot examples from each of 48 Flan-v2 tasks. Flan-v2 is not available
here, so a "task" is one WikiText-2 article (articles start at a ` = Title = ` line), and
optionally ARC-Easy questions with their correct answers form one more, labelled task.
Every sample is a window of `seqlen` tokens, so samples batch as [N, seqlen].
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from cmoe_jax.data.text_sources import DataError, _check_file, wikitext_items_from_file

_TITLE = re.compile(r"^ = [^=].* = $")


def wikitext_articles(path) -> list[str]:
    """The articles of a raw WikiText-2 file (text of each, title line included)."""
    path = Path(path)
    _check_file(path)
    articles: list[list[str]] = []
    for line in wikitext_items_from_file(path):
        if _TITLE.match(line.rstrip("\n")):
            articles.append([])
        if articles:
            articles[-1].append(line)
    return ["\n\n".join(a) for a in articles]


def arc_text(path, limit: int = 400) -> str:
    """The first `limit` ARC questions (JSON lines) as `Question: ...\\nAnswer: ...` blocks."""
    path = Path(path)
    _check_file(path)
    blocks = []
    with path.open() as f:
        for line in f:
            if len(blocks) >= limit:
                break
            q = json.loads(line)
            answer = q["choices"]["text"][q["choices"]["label"].index(q["answerKey"])]
            blocks.append(f"Question: {q['question']}\nAnswer: {answer}")
    return "\n\n".join(blocks)


def task_windows(texts, tokenizer, samples_per_task: int, seqlen: int, max_tasks: int) -> tuple[np.ndarray, np.ndarray]:
    """(windows int32 [N, seqlen], task ids int32 [N]): the first `samples_per_task`
    non-overlapping windows of each text long enough for them, the first `max_tasks` such texts."""
    if samples_per_task < 1 or max_tasks < 1 or seqlen < 2:
        raise DataError(f"need samples_per_task >= 1, tasks >= 1, seqlen >= 2 (got {samples_per_task}, "
                        f"{max_tasks}, {seqlen})")
    windows, ids = [], []
    need = samples_per_task * seqlen
    for text in texts:
        tokens = np.asarray(tokenizer.encode(text), np.int32)
        if len(tokens) < need:
            continue
        windows.append(tokens[:need].reshape(samples_per_task, seqlen))
        ids += [len(windows) - 1] * samples_per_task
        if len(windows) == max_tasks:
            break
    if not windows:
        lower = "--samples-per-task or --seqlen" if samples_per_task > 1 else "--seqlen"
        raise DataError(f"no calibration text has {need} tokens ({samples_per_task} x {seqlen}): lower {lower}")
    return np.concatenate(windows), np.asarray(ids, np.int32)

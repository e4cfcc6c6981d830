"""Fault injection for testing: `CMOE_FAULT_AT=<point>:<n>` kills the job with SIGKILL the
n-th time it passes the named point (a real kill, as a power cut or the OOM killer would).
`CMOE_FAULT_PAUSE=<point>:<n>:<dir>` instead stops there until `<dir>/go` exists, after
creating `<dir>/paused`: a test can then act at that exact moment (a publish between two
reads of a reader), deterministically rather than by chance. `CMOE_FAULT_COUNT=<file>`
keeps the passes of every point in that file (a campaign learns where it can kill).

Jobs call `fault_point(name)` at the moments where a crash could leave something behind
(after each saved layer or shard, inside a write, between the steps of a publish, inside
the cleanup), readers between the pieces they read. Without the variables this costs three
dictionary lookups. It sits in the lowest layer so the checkpoint reader can use it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from collections import Counter
from pathlib import Path

FAULT_ENV = "CMOE_FAULT_AT"
PAUSE_ENV = "CMOE_FAULT_PAUSE"
COUNT_ENV = "CMOE_FAULT_COUNT"  # a file: the passes of every point so far, as JSON
_passed: Counter = Counter()


def _target(env: str) -> tuple[str, int, str] | None:
    spec = os.environ.get(env)
    if not spec:
        return None
    if env == PAUSE_ENV:  # the point's name may hold ":" itself: the pass is the first number
        name, n, where = re.fullmatch(r"(.+?):(\d+):(.*)", spec).groups()
        return name, int(n), where
    name, _, n = spec.rpartition(":")
    return name, int(n), ""


def fault_point(name: str) -> None:
    """Count one pass of point `name`; SIGKILL this process (or pause it) when the
    environment names this pass."""
    kill, pause, count = _target(FAULT_ENV), _target(PAUSE_ENV), os.environ.get(COUNT_ENV)
    if kill is None and pause is None and not count:
        return
    _passed[name] += 1
    if count:  # a fault campaign learns where it can kill from one uninterrupted run
        Path(count).write_text(json.dumps(_passed))
    if kill is not None and kill[:2] == (name, _passed[name]):
        os.kill(os.getpid(), signal.SIGKILL)
    if pause is not None and pause[:2] == (name, _passed[name]):
        where = Path(pause[2])
        (where / "paused").touch()
        while not (where / "go").exists():
            time.sleep(0.01)


def reset_counts() -> None:
    """Forget the passes counted so far (a test that runs several jobs in one process)."""
    _passed.clear()

"""Fault injection for testing: `CMOE_FAULT_AT=<point>:<n>` kills the job with SIGKILL the
n-th time it passes the named point (a real kill, as a power cut or the OOM killer would).

Jobs call `fault_point(name)` at the moments where a crash could leave something behind
(after each saved layer or shard, between the steps of a publish). Without the variable
this costs one dictionary lookup.
"""
from __future__ import annotations

import os
import signal
from collections import Counter

FAULT_ENV = "CMOE_FAULT_AT"
_passed: Counter = Counter()


def _target() -> tuple[str, int] | None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    name, _, n = spec.rpartition(":")
    return name, int(n)


def fault_point(name: str) -> None:
    """Count one pass of point `name`; SIGKILL this process if `CMOE_FAULT_AT` names this pass."""
    target = _target()
    if target is None:
        return
    _passed[name] += 1
    if target == (name, _passed[name]):
        os.kill(os.getpid(), signal.SIGKILL)

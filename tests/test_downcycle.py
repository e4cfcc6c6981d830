"""Downcycling: the load-balancing loss and its gradient against a direct numpy computation,
a tiny full-parameter run that resumes to the same losses, the Python API giving what the
command gives on the same settings, and the settings' checks before any work."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from cmoe_jax.downcycle import DowncycleSettings, DowncycleTraining, downcycle
from cmoe_jax.downcycle.cli import main as train_main
from cmoe_jax.errors import CmoeError
from cmoe_jax.methods.expertweaver.downcycle_objective import load_balance_loss
from tests.test_expertweaver import _articles


def _direct(x, w, k):
    logits = x @ w
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    top = np.argsort(-p, axis=1)[:, :k]
    e, t = w.shape[1], len(x)
    f = np.bincount(top.ravel(), minlength=e) / (t * k)
    loss = e * np.sum(f * p.mean(0))
    # d loss / d logits_t = e / T * p_t * (f - p_t . f)   (f is a count: no gradient)
    dlogits = e / t * p * (f[None, :] - (p * f[None, :]).sum(1, keepdims=True))
    return loss, x.T @ dlogits


def test_load_balance_loss_value_and_gradient():
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(50, 8)), rng.normal(size=(8, 6))
    want, want_grad = _direct(x, w, 2)
    got, grad = jax.value_and_grad(lambda w_: load_balance_loss(x, w_, 2))(w.astype(np.float32))
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-6)
    # balanced routing with uniform probabilities gives exactly 1
    assert float(load_balance_loss(x, np.zeros((8, 6), np.float32), 6)) == np.float32(1.0)


def _args(path, text, out, *extra):
    return ["--model", str(path), "--data-path", str(text), "--experts", "8",
            "--active", "4", "--shared-experts", "1", "--calib-tasks", "4", "--steps", "4",
            "--batch-size", "2", "--seqlen", "16", "--save-every", "2", "--out", str(out), *extra]


def test_downcycle_trains_and_resumes_identically(tiny_checkpoint, tmp_path):
    _, path, _ = tiny_checkpoint
    text = _articles(tmp_path / "a.txt")
    assert train_main(_args(path, text, tmp_path / "full", "--layers", "1")) == 0
    full = json.loads((tmp_path / "full" / "train_log.json").read_text())["steps"]
    assert len(full) == 4 and all(np.isfinite(s["loss"]) and s["aux"] > 0 for s in full)
    # a run killed (SIGKILL) right after its step-2 checkpoint
    proc = subprocess.run([sys.executable, "-m", "cmoe_jax.downcycle",
                           *_args(path, text, tmp_path / "res", "--layers", "1")],
                          env=dict(os.environ, CMOE_FAULT_AT="checkpoint:1"),
                          cwd=Path(__file__).resolve().parents[1], capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert not (tmp_path / "res").exists()
    assert (tmp_path / "res.partial" / "final" / "checkpoints" / "2").is_dir()
    assert train_main(_args(path, text, tmp_path / "res", "--layers", "1", "--resume")) == 0
    res = json.loads((tmp_path / "res" / "train_log.json").read_text())["steps"]
    np.testing.assert_allclose([s["loss"] for s in res], [s["loss"] for s in full], rtol=1e-5)


def _settings(text, **kw) -> DowncycleSettings:
    """What `_args` says, as settings."""
    return DowncycleSettings(data_path=str(text), experts=8, active=4, shared_experts=1, calib_tasks=4,
                             seqlen=16, **kw, training=DowncycleTraining(steps=4, batch_size=2, save_every=2))


def test_the_api_runs_what_the_command_runs(tiny_checkpoint, tmp_path, capsys):
    _, path, _ = tiny_checkpoint
    text = _articles(tmp_path / "a.txt")
    assert train_main(_args(path, text, tmp_path / "cli", "--layers", "1")) == 0
    printed = json.loads(capsys.readouterr().out)
    result = downcycle(str(path), _settings(text, layers=1), out=tmp_path / "api", progress=False)
    cli, api = (json.loads((tmp_path / d / "train_log.json").read_text()) for d in ("cli", "api"))
    assert result == {**api, "steps": 4, "out": str(tmp_path / "api")}  # the log's summary
    assert {k: result[k] for k in printed if k != "out"} == {k: v for k, v in printed.items() if k != "out"}
    assert {k: v for k, v in api.items() if k != "steps"} == {k: v for k, v in cli.items() if k != "steps"}
    assert [{k: v for k, v in s.items() if k != "seconds"} for s in api["steps"]] == \
        [{k: v for k, v in s.items() if k != "seconds"} for s in cli["steps"]]
    assert sorted(p.name for p in (tmp_path / "api").iterdir()) == ["checkpoints", "loss.png", "train_log.json"]


@pytest.mark.parametrize("change, message", [
    (dict(experts=4, active=8), "need 0 <= --shared-experts (2) < --active (8) <= --experts (4)"),
    (dict(init="zeros"), "--init 'zeros' must be one of expertweaver, random-split, random"),
    (dict(seqlen=1), "--seqlen must be at least 2"),
    (dict(layers=0), "--layers must be at least 1, got 0"),
    (dict(training=DowncycleTraining(steps=0)), "--steps must be at least 1, got 0"),
    (dict(training=DowncycleTraining(lr=float("nan"))), "--lr must be a finite number"),
    (dict(training=DowncycleTraining(warmup=2.5)), "--warmup: '2.5' is not an integer"),
    (dict(data_path="missing.txt"), "--data-path missing.txt does not exist: give an existing file"),
])
def test_bad_settings_fail_before_any_work(tmp_path, change, message):
    """The flags' own bounds hold for settings built in Python: one line, nothing written,
    the model never opened."""
    text = _articles(tmp_path / "a.txt")
    settings = DowncycleSettings(**{"data_path": str(text), **change})
    with pytest.raises(CmoeError, match="^" + re.escape(message)):
        downcycle("no-such-model", settings, out=tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]

"""Downcycling: the load-balancing loss and its gradient against a direct numpy computation,
and a tiny full-parameter run that resumes to the same losses."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from cmoe_jax.downcycle import main as train_main
from cmoe_jax.methods.expertweaver.downcycle import load_balance_loss
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

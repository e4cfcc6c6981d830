"""Perplexity against a direct transformers computation, data parallelism, CLI errors."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cmoe_jax.eval import perplexity
from cmoe_jax.eval.cli import main as eval_main
from cmoe_jax.loading import load_model

ROOT = Path(__file__).resolve().parents[1]


def test_perplexity_matches_transformers(tiny_checkpoint):
    model, path, _ = tiny_checkpoint
    windows = np.random.default_rng(0).integers(0, 96, size=(5, 33)).astype(np.int32)
    with torch.no_grad():
        losses = [model(torch.tensor(w[None]).long(), labels=torch.tensor(w[None]).long()).loss.item() for w in windows]
    ref = math.exp(float(np.mean(losses)))
    r = perplexity(load_model(str(path), progress=False).model, windows, batch_size=2, progress=False)
    assert r["windows"] == 5 and r["tokens"] == 5 * 32
    assert abs(r["ppl"] - ref) / ref < 1e-5


def _cli_json(path, text, out_json, env_devices):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={env_devices}",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "cmoe_jax.eval", "--model", str(path), "--dataset", "wikitext2",
                    "--data-path", str(text), "--seqlen", "32", "--json", str(out_json), "--no-progress"],
                   check=True, env=env, cwd=ROOT)
    return json.loads(out_json.read_text())


def test_eight_devices_same_perplexity_as_one(tiny_checkpoint, tmp_path):
    _, path, text = tiny_checkpoint
    one = _cli_json(path, text, tmp_path / "one.json", 1)
    eight = _cli_json(path, text, tmp_path / "eight.json", 8)
    assert one["devices"] == 1 and eight["devices"] == 8
    assert one["windows"] == eight["windows"] > 8  # several steps, last one padded
    assert abs(one["ppl"] - eight["ppl"]) / one["ppl"] < 1e-6
    for key in ("ppl", "windows", "tokens", "tokens_per_s"):
        assert key in one


def _expect_error(argv, capsys, out_json, message):
    assert eval_main(argv + ["--json", str(out_json), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1 and message in err, err
    assert not out_json.exists()


def test_cli_errors(tiny_checkpoint, tmp_path, capsys):
    _, path, text = tiny_checkpoint
    out = tmp_path / "r.json"
    base = ["--dataset", "wikitext2", "--data-path", str(text), "--seqlen", "32"]
    _expect_error(["--model", str(tmp_path / "missing")] + base, capsys, out, "does not exist")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    _expect_error(["--model", str(gpt2)] + base, capsys, out, "unsupported model_type")
    _expect_error(["--model", str(path), "--dataset", "wikitext2", "--data-path", str(text),
                   "--seqlen", "4096"], capsys, out, "exceeds the model's context")
    short = tmp_path / "short.txt"
    short.write_text("w1 w2\n")
    _expect_error(["--model", str(path), "--dataset", "wikitext2", "--data-path", str(short),
                   "--seqlen", "32"], capsys, out, "fewer than one window")


def test_cli_errors_on_broken_weights(tiny_checkpoint, tmp_path, capsys):
    _, path, text = tiny_checkpoint
    out = tmp_path / "r.json"
    base = ["--model", str(path), "--dataset", "wikitext2", "--data-path", str(text), "--seqlen", "32"]
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, hidden_size=48)))
    _expect_error(base, capsys, out, "has shape")
    (path / "config.json").write_text(json.dumps(cfg))
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    _expect_error(base, capsys, out, "corrupted or truncated")

"""Perplexity against a direct transformers computation, data parallelism, CLI errors."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import Mesh

from cmoe_jax.data import DataError
from cmoe_jax.eval import perplexity
from cmoe_jax.eval.cli import main as eval_main
from cmoe_jax.loading import load_model

from conftest import xla_flags

ROOT = Path(__file__).resolve().parents[1]


def torch_ppl(model, windows: np.ndarray) -> float:
    """Reference: summed cross-entropy of logits[:-1] vs tokens[1:] over all windows, float64."""
    total = 0.0
    with torch.no_grad():
        for w in windows:
            x = torch.tensor(w[None]).long()
            logits = model(x).logits[0, :-1].double()
            total += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
    return math.exp(total / (windows.shape[0] * (windows.shape[1] - 1)))


class LogitsOnly(nnx.Module):
    """A model exposing only `__call__ -> logits` (no token_nll): the generic path."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, tokens):
        return self.inner(tokens)


@pytest.fixture
def tiny(tiny_checkpoint):
    model, path, text = tiny_checkpoint
    windows = np.random.default_rng(0).integers(0, 96, size=(5, 33)).astype(np.int32)
    return model, load_model(str(path), progress=False), windows, path, text


def test_perplexity_matches_transformers(tiny):
    ref_model, lm, windows, _, _ = tiny
    ref = torch_ppl(ref_model, windows)
    r = perplexity(lm.model, windows, progress=False)
    assert r["windows"] == 5 and r["tokens"] == 5 * 32 and r["devices"] == len(jax.devices())
    assert abs(r["ppl"] - ref) / ref < 1e-5
    assert math.isclose(r["ppl"], math.exp(r["nll"]))
    assert r["tokens_per_s"] > 0 and r["seconds"] > 0 and r["compile_seconds"] > 0
    generic = perplexity(LogitsOnly(lm.model), windows, progress=False)
    assert abs(generic["ppl"] - ref) / ref < 1e-5


@pytest.mark.parametrize("batch_size", [1, 2, 3, 5, 64])
def test_batch_size_and_padding_do_not_change_the_result(tiny, batch_size):
    ref_model, lm, windows, _, _ = tiny
    r = perplexity(lm.model, windows, batch_size=batch_size, progress=False)
    assert r["batch_size"] == min(batch_size, 5)
    ref = torch_ppl(ref_model, windows)
    assert abs(r["ppl"] - ref) / ref < 1e-5


def test_compiled_step_is_reused(tiny):
    _, lm, windows, _, _ = tiny
    first = perplexity(lm.model, windows[:, :17], batch_size=4, progress=False)
    again = perplexity(lm.model, windows[:, :17], batch_size=4, progress=False)
    assert again["ppl"] == first["ppl"] and again["compile_seconds"] < first["compile_seconds"] / 10


def test_padding_windows_are_masked_out(tiny):
    """Padded copies of window 0 must not count: a run with one odd window out differs."""
    _, lm, windows, _, _ = tiny
    three = perplexity(lm.model, windows[:3], batch_size=2, progress=False)  # 2 steps, 1 pad
    alone = [perplexity(lm.model, windows[i:i + 1], progress=False)["nll"] for i in range(3)]
    assert abs(three["nll"] - np.mean(alone)) < 1e-6


def test_explicit_mesh_and_bfloat16(tiny, tiny_checkpoint):
    ref_model, lm, windows, path, _ = tiny
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    r = perplexity(lm.model, windows, mesh=mesh, progress=False)
    assert r["devices"] == 1
    ref = torch_ppl(ref_model, windows)
    bf16 = perplexity(load_model(str(path), dtype=jnp.bfloat16, progress=False).model, windows, progress=False)
    assert abs(bf16["ppl"] - ref) / ref < 2e-2  # bf16 weights and activations, fp32 log-softmax
    with pytest.raises(ValueError, match="'data' axis"):
        perplexity(lm.model, windows, mesh=Mesh(np.array(jax.devices()[:1]), ("batch",)), progress=False)


def test_bad_windows(tiny):
    _, lm, windows, _, _ = tiny
    with pytest.raises(DataError, match=r"token ids must lie in \[0, 96\)"):
        perplexity(lm.model, windows + 200, progress=False)
    with pytest.raises(DataError, match="exceed the model's context of 128"):
        perplexity(lm.model, np.zeros((1, 129), np.int32), progress=False)
    with pytest.raises(DataError, match=r"\[N, T\]"):
        perplexity(lm.model, np.zeros((2, 1), np.int32), progress=False)


_MESH_SCRIPT = """
import json, sys
import jax, numpy as np
from cmoe_jax.eval import perplexity
from cmoe_jax.loading import load_model
lm = load_model(sys.argv[1], progress=False)
w = np.load(sys.argv[2])
out = {str(b): perplexity(lm.model, w, batch_size=b, progress=False) for b in (None, 12)}
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
out["2x4"] = perplexity(lm.model, w, mesh=mesh, progress=False)  # params split over "model"
print(json.dumps({"n": len(jax.devices()), "runs": out}))
"""


def _subprocess_env(devices: int) -> dict:
    return dict(os.environ, XLA_FLAGS=xla_flags(devices),
                JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))


def test_eight_devices_same_perplexity_as_one(tiny, tmp_path):
    _, lm, _, path, _ = tiny
    windows = np.random.default_rng(1).integers(0, 96, size=(13, 33)).astype(np.int32)  # 13: padded
    np.save(tmp_path / "w.npy", windows)
    one = perplexity(lm.model, windows, mesh=Mesh(np.array(jax.devices()[:1]), ("data",)), progress=False)
    proc = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, str(path), str(tmp_path / "w.npy")],
                          env=_subprocess_env(8), cwd=ROOT, capture_output=True, text=True, check=True)
    eight = json.loads(proc.stdout.strip().splitlines()[-1])
    assert eight["n"] == 8
    for key, run in eight["runs"].items():
        assert run["devices"] == {"2x4": 2}.get(key, 8)
        assert run["batch_size"] == {"None": 8, "12": 16, "2x4": 2}[key]
        assert run["windows"] == 13 and run["tokens"] == 13 * 32
        assert abs(run["ppl"] - one["ppl"]) / one["ppl"] < 1e-6


def test_cli_on_eight_devices_writes_json(tiny, tmp_path):
    _, _, _, path, text = tiny
    out = tmp_path / "eight.json"
    subprocess.run([sys.executable, "-m", "cmoe_jax.eval", "--model", str(path), "--dataset", "wikitext2",
                    "--data-path", str(text), "--seqlen", "32", "--max-windows", "20", "--json", str(out),
                    "--no-progress"], check=True, env=_subprocess_env(8), cwd=ROOT, capture_output=True)
    eight = json.loads(out.read_text())
    one_json = tmp_path / "one.json"
    assert eval_main(["--model", str(path), "--data-path", str(text), "--seqlen", "32", "--max-windows", "20",
                      "--json", str(one_json), "--no-progress"]) == 0
    one = json.loads(one_json.read_text())
    for key in ("ppl", "nll", "windows", "tokens", "tokens_per_s", "model", "dataset", "seqlen", "dtype", "devices"):
        assert key in eight and key in one
    assert eight["devices"] == 8 and eight["windows"] == one["windows"] == 20 and eight["tokens"] == 20 * 31
    assert eight["dataset"] == "wikitext2" and eight["seqlen"] == 32 and eight["dtype"] == "float32"
    assert abs(one["ppl"] - eight["ppl"]) / one["ppl"] < 1e-6
    assert not list(tmp_path.glob("*.tmp"))


def test_cli_prints_result(tiny, capsys):
    _, _, _, path, text = tiny
    assert eval_main(["--model", str(path), "--data-path", str(text), "--seqlen", "64", "--max-windows", "3",
                      "--batch-size", "2", "--no-progress"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("wikitext2 perplexity ") and "over 3 windows x 64 (189 predicted tokens)" in line


def _expect_error(argv, capsys, out_json, message):
    assert eval_main(argv + ["--json", str(out_json), "--no-progress"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and message in err, err
    assert captured.out == ""
    assert not out_json.exists() and not list(out_json.parent.glob(f".{out_json.name}*"))


def test_cli_errors(tiny, tmp_path, capsys, monkeypatch):
    _, _, _, path, text = tiny
    out = tmp_path / "r.json"
    base = ["--dataset", "wikitext2", "--data-path", str(text), "--seqlen", "32"]
    _expect_error(["--model", str(tmp_path / "missing")] + base, capsys, out, "does not exist")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    _expect_error(["--model", str(gpt2)] + base, capsys, out, "unsupported model_type")
    _expect_error(["--model", str(path), "--data-path", str(text), "--seqlen", "4096"], capsys, out,
                  "--seqlen 4096 exceeds the model's context of 128 tokens")
    short = tmp_path / "short.txt"
    short.write_text("w1 w2\n")
    _expect_error(["--model", str(path), "--data-path", str(short), "--seqlen", "32"], capsys, out,
                  f"wikitext2 ({short}) has 2 tokens, fewer than one window of 32")
    _expect_error(["--model", str(path), "--data-path", str(tmp_path / "nope.txt"), "--seqlen", "32"], capsys, out,
                  "nope.txt does not exist")
    _expect_error(["--model", str(path)] + base + ["--max-windows", "0"], capsys, out, "--max-windows must be")
    _expect_error(["--model", str(path)] + base + ["--batch-size", "0"], capsys, out, "--batch-size must be")
    _expect_error(["--model", str(path)] + base[:-1] + ["1"], capsys, out, "--seqlen must be at least 2")
    monkeypatch.setitem(sys.modules, "datasets", None)  # neither download library installed
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    _expect_error(["--model", str(path), "--dataset", "c4", "--seqlen", "32"], capsys, out,
                  "pip install -e '.[datasets]'")
    bad_json = tmp_path / "no_dir" / "r.json"
    assert eval_main(["--model", str(path)] + base + ["--json", str(bad_json), "--no-progress"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_errors_on_broken_weights(tiny, tmp_path, capsys):
    _, _, _, path, text = tiny
    out = tmp_path / "r.json"
    base = ["--model", str(path), "--dataset", "wikitext2", "--data-path", str(text), "--seqlen", "32"]
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, hidden_size=48)))
    _expect_error(base, capsys, out, "has shape")
    (path / "config.json").write_text(json.dumps(cfg))
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    _expect_error(base, capsys, out, "corrupted or truncated")
    # the cheap checks come first: a short dataset or a too-long seqlen is reported without
    # reading the (broken) weights
    short = tmp_path / "short.txt"
    short.write_text("w1 w2\n")
    _expect_error(["--model", str(path), "--data-path", str(short), "--seqlen", "32"], capsys, out,
                  "fewer than one window")
    _expect_error(["--model", str(path), "--data-path", str(text), "--seqlen", "256"], capsys, out,
                  "exceeds the model's context")

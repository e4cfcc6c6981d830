"""The core install has no torch: every library path must work with torch unimportable.

Each check runs in a subprocess where `sys.modules["torch"] = None`, which is what an
environment without torch looks like to Python (`import torch` raises ImportError and
`importlib.util.find_spec("torch")` is None), so the suite fails the day a torch import
sneaks back into a core path, directly or through transformers.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BLOCK_TORCH = "import sys; sys.modules['torch'] = None\n"

_SCRIPT = BLOCK_TORCH + r"""
import importlib, json, pkgutil, sys
import cmoe_jax

EXTRAS = {"cmoe_jax.eval.lmeval"}  # the [lmeval] extra (lm-eval brings torch)
for mod in pkgutil.walk_packages(cmoe_jax.__path__, "cmoe_jax."):
    if not mod.name.endswith(".__main__") and mod.name not in EXTRAS:  # __main__ runs a CLI
        importlib.import_module(mod.name)

from cmoe_jax.convert.cli import main as convert_main
from cmoe_jax.eval.cli import main as eval_main
from cmoe_jax.loading import load_config, load_tokenizer, smollm2_gguf

model, text, out = sys.argv[1:4]
assert load_config("smollm2")[0].num_layers == 30
assert load_tokenizer(smollm2_gguf()).encode("Hello world") == [19556, 905]
common = ["--data-path", text, "--seqlen", "32"]
assert convert_main(["--model", model, "--config", "S1A1E8", "--calib", "wikitext2",
                     "--calib-samples", "2", "--k-act", "4", "--out", out, *common]) == 0
assert eval_main(["--model", out, "--dataset", "wikitext2", "--max-windows", "2",
                  "--json", out + ".ppl.json", "--no-progress", *common]) == 0
assert sys.modules.get("torch") is None, "torch was imported"
print(json.dumps(sorted(m for m, v in sys.modules.items() if m.split(".")[0] == "torch" and v is not None)))
"""


def test_load_convert_eval_with_torch_unimportable(tiny_checkpoint, tmp_path):
    _, path, text = tiny_checkpoint
    out = tmp_path / "converted"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(path), str(text), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
    assert json.loads(out.with_name("converted.ppl.json").read_text())["ppl"] > 1


def test_block_really_blocks_torch():
    """The guard itself: with the block, importing torch fails as on a core install."""
    proc = subprocess.run([sys.executable, "-c", BLOCK_TORCH + "import torch"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


def test_missing_optional_dependency_is_one_error_line(tmp_path):
    """A `.bin` checkpoint without torch: one `error:` line naming the extra, exit 2."""
    from tests.conftest import save_tiny_tokenizer, write_random_text

    save_tiny_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 96, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    text = write_random_text(tmp_path / "t.txt", 200)
    proc = subprocess.run([sys.executable, "-c", BLOCK_TORCH + "from cmoe_jax.eval.cli import main;"
                           "raise SystemExit(main(sys.argv[1:]))", "--model", str(tmp_path),
                           "--dataset", "wikitext2", "--data-path", str(text), "--seqlen", "4"],
                          cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error:") and ".[torch]" in lines[0]


def test_lmeval_backend_without_its_extra_is_one_error_line():
    """The [lmeval] extra missing: one `error:` line naming it, exit 2."""
    block = BLOCK_TORCH + "sys.modules['lm_eval'] = None\n"
    proc = subprocess.run([sys.executable, "-c", block + "import runpy; runpy.run_module("
                           "'cmoe_jax.eval.lmeval', run_name='__main__')"],
                          cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error:") and ".[lmeval]" in lines[0]


def test_the_library_entries_load_only_what_they_use():
    """`import cmoe_jax.moe` and `from cmoe_jax import carve_ffn` are library calls: they load
    no checkpoint, tokenizer, dataset, plotting or GGUF library, nor numba (which the carving
    loads when its assignment first runs)."""
    heavy = ("orbax", "tensorstore", "gguf", "safetensors", "transformers", "datasets", "numba",
             "matplotlib", "torch")
    for entry in ("import cmoe_jax.moe", "from cmoe_jax import carve_ffn"):
        script = (f"import sys, json\n{entry}\n"
                  f"print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))")
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == [], (entry, proc.stdout)

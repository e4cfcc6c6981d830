"""The `cmoe_jax` lm-evaluation-harness backend against lm-eval's own Hugging Face backend."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lm_eval")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import cmoe_jax.eval.lmeval  # noqa: E402,F401  (registers the backend)
from cmoe_jax.eval.cli import main as eval_main  # noqa: E402
from test_tasks import write_arc_like  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARC = ROOT.parent / "shared" / "data" / "arc-easy" / "test.jsonl"


def local_arc_task(directory: Path, data: Path, name: str = "arc_local") -> TaskManager:
    """lm-eval's arc_easy task definition over a local JSON-lines file."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.yaml").write_text(
        (ROOT / "eval_tasks" / "arc_easy_local.yaml").read_text()
        .replace("task: arc_easy_local", f"task: {name}")
        .replace("../shared/data/arc-easy/test.jsonl", str(data)))
    return TaskManager(include_path=str(directory))


def run_both(pretrained, task_manager, name, limit, hf_args=None):
    results = {}
    for backend, args in (("cmoe_jax", f"pretrained={pretrained},progress=False"),
                          ("hf", hf_args or f"pretrained={pretrained},dtype=float32,device=cpu")):
        out = simple_evaluate(model=backend, model_args=args, tasks=[name], task_manager=task_manager,
                              limit=limit, batch_size=4, log_samples=True, verbosity="WARNING")
        results[backend] = out
    return results


def assert_same_results(results, name, atol):
    ours, ref = results["cmoe_jax"], results["hf"]
    for metric in ("acc,none", "acc_norm,none", "acc_stderr,none", "acc_norm_stderr,none"):
        assert ours["results"][name][metric] == ref["results"][name][metric], metric
    ours_ll = np.array([float(r[0][0]) for s in ours["samples"][name] for r in s["resps"]])
    ref_ll = np.array([float(r[0][0]) for s in ref["samples"][name] for r in s["resps"]])
    assert len(ours_ll) == len(ref_ll) > 0
    np.testing.assert_allclose(ours_ll, ref_ll, atol=atol)


def test_backend_equals_lm_evals_hf_backend_on_a_local_task(tiny_checkpoint, tmp_path):
    _, path, _ = tiny_checkpoint
    data = write_arc_like(tmp_path / "arc.jsonl", n=10)
    tm = local_arc_task(tmp_path / "tasks", data)
    results = run_both(path, tm, "arc_local", limit=None)
    assert_same_results(results, "arc_local", atol=1e-4)
    # our own CLI gives lm-eval's figures on the same file
    out = tmp_path / "cli.json"
    assert eval_main(["--model", str(path), "--task", "arc_easy", "--data-path", str(data),
                      "--json", str(out), "--no-progress"]) == 0
    cli = json.loads(out.read_text())
    for metric in ("acc", "acc_norm", "acc_stderr", "acc_norm_stderr"):
        assert cli[metric] == pytest.approx(results["hf"]["results"]["arc_local"][f"{metric},none"])


def test_rolling_and_greedy_generation_equal_the_hf_backend(tiny_checkpoint):
    from lm_eval.models.huggingface import HFLM

    from cmoe_jax.eval.lmeval import CmoeJaxLM
    from conftest import WORDS

    import transformers

    _, path, _ = tiny_checkpoint
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    tok.eos_token = "w0"  # generation needs an end-of-text token: the tiny model's config says id 2
    tok.save_pretrained(str(path))
    ours = CmoeJaxLM(pretrained=str(path), progress=False, max_length=32)
    ref = HFLM(pretrained=str(path), dtype="float32", device="cpu", batch_size=2, max_length=32)
    texts = [" ".join(WORDS[i:i + n]) for i, n in ((0, 5), (3, 70), (10, 31))]
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    np.testing.assert_allclose(ours.loglikelihood_rolling(rolling, disable_tqdm=True),
                               ref.loglikelihood_rolling(rolling, disable_tqdm=True), atol=1e-4)
    gen = [Instance("generate_until", {}, (" ".join(WORDS[i:i + 6]), {"until": [stop], "max_gen_toks": 7}), i)
           for i, stop in enumerate(["w5", "w80", "\n"])]
    assert ours.generate_until(gen, disable_tqdm=True) == ref.generate_until(gen, disable_tqdm=True)


def test_lm_eval_command_line_runs_the_backend(tiny_checkpoint, tmp_path):
    import subprocess

    _, path, _ = tiny_checkpoint
    data = write_arc_like(tmp_path / "arc.jsonl", n=6)
    local_arc_task(tmp_path / "tasks", data)
    proc = subprocess.run([sys.executable, "-m", "cmoe_jax.eval.lmeval", "--model", "cmoe_jax",
                           "--model_args", f"pretrained={path},progress=False", "--tasks", "arc_local",
                           "--include_path", str(tmp_path / "tasks"), "--output_path", str(tmp_path / "res")],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "arc_local" in proc.stdout and "acc_norm" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(not ARC.exists(), reason="needs ../shared/data/arc-easy/test.jsonl")
def test_smollm2_backend_equals_hf_backend_on_arc_easy_slice(tmp_path):
    from cmoe_jax.loading import smollm2_gguf

    gguf = smollm2_gguf()
    tm = local_arc_task(tmp_path / "tasks", ARC)
    hf_args = f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32,device=cpu"
    results = run_both(gguf, tm, "arc_local", limit=12, hf_args=hf_args)
    assert_same_results(results, "arc_local", atol=1e-3)

"""Multi-process runs on this machine: 2 and 4 CPU processes (gloo collectives, loopback
coordinator) give the single-process conversion, evaluation and training results; a bad
multi-process environment fails with one `error:` line before any work."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import save_tiny_tokenizer, tiny_hf_model, write_random_text, xla_flags
from test_tasks import write_arc_like

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 240  # seconds per launch: a hang fails the test instead of the CI job
# several JAX processes per test: run alone, after the parallel pass (scripts/test.sh), so that
# starved processes do not miss the coordinator's topology exchange
pytestmark = pytest.mark.serial


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int = 1, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "CMOE_DISTRIBUTED"))}
    env.update(JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false",
               XLA_FLAGS=xla_flags(devices), **extra)
    return env


def launch(module: str, args: list, processes: int = 1, devices: int = 1) -> list[str]:
    """Run `python -m module args` as `processes` processes of one job; their stdout. A process
    that fails stops the launch at once, with every process's stderr in the message (a peer
    left waiting would otherwise time out at the coordinator and hide the first error)."""
    port = _free_port()
    procs, logs = [], []
    try:
        for i in range(processes):
            extra = {} if processes == 1 else dict(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                                   JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(i))
            logs.append((tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")))
            procs.append(subprocess.Popen([sys.executable, "-m", module, *map(str, args)], cwd=ROOT,
                                          env=_env(devices, **extra), stdout=logs[-1][0],
                                          stderr=logs[-1][1], text=True))
        deadline = time.monotonic() + TIMEOUT
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            assert time.monotonic() < deadline, f"{module} still running after {TIMEOUT} s"
            time.sleep(0.2)
        outs, errs = zip(*[(_read(out), _read(err)) for out, err in logs])
        failed = [i for i, p in enumerate(procs) if p.poll()]
        assert not failed, "\n".join(f"process {i} exited {procs[i].returncode}:\n{errs[i][-3000:]}"
                                      for i in failed)
        return list(outs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for files in logs:
            for f in files:
                f.close()


def _read(f) -> str:
    f.seek(0)
    return f.read()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with a tokenizer, a text file and an ARC-like task file."""
    root = tmp_path_factory.mktemp("multihost")
    tiny_hf_model("llama", intermediate_size=64).save_pretrained(root / "model")
    save_tiny_tokenizer(root / "model")
    write_random_text(root / "text.txt", 4000)
    write_arc_like(root / "arc.jsonl", n=10)
    return root


def _convert_args(tiny, out):
    return ["--model", tiny / "model", "--calib", "wikitext2", "--data-path", tiny / "text.txt",
            "--calib-samples", "4", "--seqlen", "32", "--k-act", "4", "--config", "S1A2E8",
            "--shared-by", "energy", "--out", out]


def _state(path):
    from flax import nnx

    from cmoe_jax.loading import load_model

    model = load_model(str(path), progress=False).model
    return {str(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.fixture(scope="module")
def converted(tiny):
    """The single-process conversion, the reference of every multi-process one."""
    launch("cmoe_jax.convert", _convert_args(tiny, tiny / "one"))
    return tiny / "one"


@pytest.mark.parametrize("processes, devices", [(2, 1), (4, 1), (2, 2)])
def test_conversion_equals_single_process(tiny, converted, processes, devices):
    """Windows split over the processes, statistics gathered and summed in window order,
    clustering on process 0: the same partitions, activation rates, loads and weights, bit for
    bit, except the layer's three fits (score and gate scales, down projections) and the
    stream error: XLA's batched einsums of their sums round differently with the per-process
    batch size (also on one process), so they agree to 1e-5 relative."""
    out = tiny / f"p{processes}x{devices}"
    outs = launch("cmoe_jax.convert", _convert_args(tiny, out), processes, devices)
    # gloo's own connection lines aside, only process 0 prints
    assert json.loads(outs[0][outs[0].index("{"):])["out"] == str(out)
    assert not any("{" in o for o in outs[1:])
    one = json.loads((converted / "cmoe_manifest.json").read_text())
    many = json.loads((out / "cmoe_manifest.json").read_text())
    # the two least-squares fits, and each layer's stream error (a sum over the same tokens)
    for fitted in ("router_scales", "gate_scales", "error"):
        values = [layer.pop(fitted) for r in (one, many) for layer in r["layers"]]
        half = len(values) // 2
        np.testing.assert_allclose(values[half:], values[:half], rtol=1e-5,
                                   atol=1e-6 * np.abs(values).max())
    assert many["layers"] == one["layers"]  # shared, experts, representatives, mu, load
    a, b = _state(converted), _state(out)
    assert a.keys() == b.keys()
    for k in a:  # carved slices bit for bit; router_up, u and the down rows carry the fits
        if "router_up" in k or k.endswith("'u')") or k.endswith("_down')"):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6 * np.abs(a[k]).max(), err_msg=k)
        else:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert not Path(str(out) + ".partial").exists()


@pytest.mark.parametrize("env, message", [
    (dict(JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="0"), "JAX_COORDINATOR_ADDRESS not set"),
    (dict(JAX_COORDINATOR_ADDRESS="127.0.0.1:1", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="2"),
     "JAX_PROCESS_ID=2 must lie in 0..1"),
    (dict(JAX_COORDINATOR_ADDRESS="127.0.0.1:1", JAX_NUM_PROCESSES="two", JAX_PROCESS_ID="0"),
     "JAX_NUM_PROCESSES='two' is not an integer"),
    (dict(JAX_COORDINATOR_ADDRESS="localhost", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="0"),
     "is not host:port"),
])
@pytest.mark.parametrize("module", ["cmoe_jax.convert", "cmoe_jax.eval", "cmoe_jax.train"])
def test_bad_environment_is_one_error_line(tiny, tmp_path, env, message, module):
    args = {"cmoe_jax.convert": _convert_args(tiny, tmp_path / "out"),
            "cmoe_jax.eval": ["--model", tiny / "model", "--data-path", tiny / "text.txt",
                              "--seqlen", "32", "--json", tmp_path / "r.json"],
            "cmoe_jax.train": ["--model", tiny / "model", "--data-path", tiny / "text.txt",
                               "--samples", "4", "--seqlen", "32", "--out", tmp_path / "out"]}[module]
    r = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, env=_env(1, **env),
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def _eval_json(tiny, args, processes, devices=1, name="r"):
    out = tiny / f"{name}_{processes}x{devices}.json"
    launch("cmoe_jax.eval", ["--model", tiny / "model", *args, "--no-progress", "--json", out],
           processes, devices)
    return json.loads(out.read_text())


def test_perplexity_equals_single_process(tiny):
    """Windows split over the processes, per-window NLLs gathered in order and summed once."""
    args = ["--dataset", "wikitext2", "--data-path", tiny / "text.txt", "--seqlen", "32",
            "--max-windows", "7"]
    one = _eval_json(tiny, args, 1, name="ppl")
    for processes in (2, 4):
        many = _eval_json(tiny, args, processes, name="ppl")
        assert many["windows"] == one["windows"] == 7 and many["tokens"] == one["tokens"]
        assert many["nll"] == one["nll"] and many["ppl"] == one["ppl"]


def test_multiple_choice_equals_single_process(tiny):
    """Questions split over the processes, per-question log-likelihoods gathered in order."""
    args = ["--task", "arc_easy", "--data-path", tiny / "arc.jsonl"]
    one = _eval_json(tiny, args, 1, name="arc")
    many = _eval_json(tiny, args, 2, name="arc")
    assert many["items"] == one["items"] == 10
    for key in ("acc", "acc_norm", "acc_stderr", "acc_norm_stderr"):
        assert many[key] == one[key], key
    # same questions in the same order; batching other neighbours changes the padded shapes,
    # so sums may differ in the last bits of fp32
    assert [len(q) for q in many["loglikelihoods"]] == [len(q) for q in one["loglikelihoods"]]
    np.testing.assert_allclose(np.concatenate(many["loglikelihoods"]),
                               np.concatenate(one["loglikelihoods"]), rtol=1e-6, atol=0)


def _train_args(converted, out, *extra):
    return ["--model", converted, "--data-path", converted.parent / "text.txt", "--samples", "8",
            "--seqlen", "32", "--batch-size", "4", "--lora-rank", "4", "--lr", "1e-2",
            "--router-lr", "1e-2", "--bias-speed", "1e-2", "--epochs", "2", "--save-every", "2",
            "--no-progress", "--out", out, *extra]


def _train_log(out):
    return json.loads((out / "train_log.json").read_text())


def _adapters(out):
    """{"['lora']['layers']...": array} of the saved adapters, router scales u and biases b."""
    import jax

    from cmoe_jax.train import load_adapters

    tree, _ = load_adapters(out / "adapters")
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_training_equals_single_process_and_resumes(converted, tmp_path):
    """LoRA training of the converted (MoE) model, data-parallel over 2 processes x 1 device,
    stopped after 2 of 4 steps and resumed (`--resume`) over 2 processes, against one process
    with 2 devices: the same per-step losses, adapters, router scales, biases and merged
    weights bit for bit (the same 2-way split of every batch; against one device they agree to
    float32 reduction order, see tests/test_train.py)."""
    one = tmp_path / "one"
    launch("cmoe_jax.train", _train_args(converted, one), 1, 2)
    out = tmp_path / "many"
    first = launch("cmoe_jax.train", _train_args(converted, out, "--max-steps", "2"), 2)
    assert json.loads(first[0][first[0].index("{"):])["steps"] == 2
    assert not any("{" in o for o in first[1:])  # only process 0 prints
    ref = _train_log(one)
    assert [s["loss"] for s in _train_log(out)["steps"]] == [s["loss"] for s in ref["steps"][:2]]
    launch("cmoe_jax.train", _train_args(converted, out, "--resume"), 2)
    log = _train_log(out)
    assert log["resumed_from"] == 2 and len(log["steps"]) == len(ref["steps"]) == 4
    assert log["mesh"] == ref["mesh"] == {"data": 2, "model": 1}
    assert [s["loss"] for s in log["steps"]] == [s["loss"] for s in ref["steps"]]
    assert ref["steps"][-1]["loss"] < ref["steps"][0]["loss"]  # it learns
    a, b = _adapters(one), _adapters(out)
    assert a.keys() == b.keys() and any(np.any(v) for k, v in a.items() if k.startswith("['u']"))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    sa, sb = _state(one), _state(out)
    assert sa.keys() == sb.keys()
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2", "4"]
    assert not Path(str(out) + ".partial").exists() and (out / "loss.png").is_file()


def test_export_refuses_several_processes(converted, tmp_path):
    """Export is one process's job: one error line before any work, nothing written."""
    env = dict(JAX_COORDINATOR_ADDRESS="127.0.0.1:1", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="0")
    r = subprocess.run([sys.executable, "-m", "cmoe_jax.export", "--model", str(converted),
                        "--format", "hf", "--out", str(tmp_path / "out")], cwd=ROOT,
                       env=_env(1, **env), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: python -m cmoe_jax.export does not run over several processes yet: start it as one "
        "process (unset JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID and CMOE_DISTRIBUTED)"]
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("extra, refused", [(["--stream"], "--stream"),
                                            (["--method", "expertweaver"], "--method expertweaver")])
def test_conversion_refuses_unsplit_modes_on_every_process(tiny, tmp_path, extra, refused):
    port = _free_port()
    args = _convert_args(tiny, tmp_path / "out")
    if "expertweaver" in extra:  # the CMoE-only flags would be refused first
        args = ["--model", tiny / "model", "--data-path", tiny / "text.txt", "--seqlen", "32",
                "--out", tmp_path / "out"]
    procs = [subprocess.Popen([sys.executable, "-m", "cmoe_jax.convert", *map(str, args + extra)],
                              cwd=ROOT, env=_env(1, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                                 JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        for p in procs:
            _, err = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 2, err[-2000:]
            assert f"error: {refused} not supported in a multi-process run (2 processes)" in err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert not (tmp_path / "out").exists()


def _cli_flags(module: str) -> str:
    import contextlib
    import importlib
    import io

    cli = importlib.import_module(f"cmoe_jax.{module}.cli")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    return buf.getvalue()


@pytest.mark.parametrize("script", ["tpu_pod_slice.sh", "multi_gpu_host.sh"])
def test_job_scripts_parse_and_use_real_flags(script):
    import re

    path = ROOT / "scripts" / "recipes" / "convert" / script
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)
    text = path.read_text().replace("\\\n", " ")
    commands = re.findall(r"-m cmoe_jax\.(\w+)([^\n]*)", text)
    assert {m for m, _ in commands} == {"convert", "eval"}
    for module, rest in commands:
        help_text = _cli_flags(module)
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest):
            assert re.search(rf"{flag}\b", help_text), f"{script}: {module} has no {flag}"


def test_only_process_0_tries_the_json_path(tmp_path, monkeypatch):
    """`--json` is written by process 0 alone, so only it tries the path: two processes each
    trial-creating one new file raced (one's exclusive create failed, it stopped, and its peer
    waited for it at the coordinator until a time-out). Another process takes process 0's
    verdict: its error (gathered) stops it too."""
    import argparse

    from cmoe_jax import distributed
    from cmoe_jax.errors import CmoeError
    from cmoe_jax.eval import cli

    verdicts = []  # what each simulated process contributes to the gather

    def gather(obj):
        verdicts.append(obj)
        return [main_verdict, obj]

    monkeypatch.setattr(distributed, "process_count", lambda: 2)
    monkeypatch.setattr(distributed, "gather_objects", gather)
    monkeypatch.setattr(distributed, "broadcast_from_main", lambda obj: None)
    bad = argparse.Namespace(model="smollm2", out=str(tmp_path / "missing" / "r.json"))
    good = argparse.Namespace(model="smollm2", out=str(tmp_path / "r.json"))

    monkeypatch.setattr(distributed, "process_index", lambda: 1)
    main_verdict = None
    cli._validate_args(bad)  # not tried here: process 0 found it writable
    assert verdicts == [None]
    main_verdict = ("CmoeError", "--out: directory missing does not exist")
    with pytest.raises(distributed.DistributedError, match="another process failed: CmoeError: --out"):
        cli._validate_args(good)

    monkeypatch.setattr(distributed, "process_index", lambda: 0)
    main_verdict = None
    with pytest.raises(CmoeError, match="does not exist: create it first"):
        cli._validate_args(bad)
    cli._validate_args(good)
    assert not list(tmp_path.iterdir())  # the trial file removed, nothing else made

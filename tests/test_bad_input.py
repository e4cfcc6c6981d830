"""Bad input, one table for every job: each case prints exactly one `error:` line, exits 2,
and writes nothing (no output, no `OUT.partial`, no lock file). Plus the job layer's
promises that are not bad input: an unexpected error keeps its traceback, publish never
touches a sibling it did not create, a staging directory that is not ours is never deleted,
and an export that transformers reads back differently fails."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cmoe_jax.checkpoint.seal import sealed
from cmoe_jax.methods.cmoe import MoEPlan
from cmoe_jax.compress.cli import main as compress_main
from cmoe_jax.convert import Calibration, ConvertConfig, ConvertSettings, convert
from cmoe_jax.convert.cli import main as convert_main
from cmoe_jax.errors import run_job
from cmoe_jax.export import ExportError, ExportSettings, export
from cmoe_jax.export.cli import main as export_main
from cmoe_jax.eval.cli import main as eval_main
from cmoe_jax.export.verify import compare_with_transformers, require_match
from cmoe_jax.generate import main as generate_main
from cmoe_jax.jobs import OutputLock
from cmoe_jax.loading import load_model
from cmoe_jax.train.cli import main as train_main
from cmoe_jax.downcycle.cli import main as downcycle_main
from tests.conftest import save_tiny_tokenizer, tiny_hf_model, write_random_text
from tests.test_expertweaver import _articles

ROOT = Path(__file__).resolve().parents[1]


def _tiny_job(text) -> ConvertSettings:
    """S1A1E8 on two 32-token windows of `text`: the smallest conversion the table needs."""
    return ConvertSettings(ConvertConfig(plan=MoEPlan.parse("S1A1E8"), k_act=4),
                      Calibration(data_path=str(text), samples=2, seqlen=32))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny dense Llama with a tokenizer, a text file, and its S1A1E8 conversion."""
    root = tmp_path_factory.mktemp("bad_input")
    dense = root / "dense"
    tiny_hf_model("llama", intermediate_size=64).save_pretrained(dense)
    save_tiny_tokenizer(dense)
    text = write_random_text(root / "calib.txt", 3000)
    converted = root / "converted"
    convert(str(dense), _tiny_job(text), out=converted, progress=False)
    return {"dense": dense, "text": text, "converted": converted, "root": root,
            "articles": _articles(root / "articles.txt")}


def _convert(i, out, *extra, model=None):
    return convert_main(["--model", str(model or i["dense"]), "--data-path", str(i["text"]),
                         "--calib-samples", "2", "--seqlen", "32", "--k-act", "4", "--config", "S1A1E8",
                         "--out", str(out), *extra])


def _compress(i, out, *extra, model=None):
    return compress_main(["--model", str(model or i["converted"]), "--data-path", str(i["text"]),
                          "--calib-samples", "2", "--seqlen", "32", "--method", "conmoe", "--ratio",
                          "0.5", "--out", str(out), *extra])


def _export(i, out, *extra, model=None):
    return export_main(["--model", str(model or i["converted"]), "--calib-samples", "0",
                        "--no-progress", "--out", str(out), *extra])


def _train(i, out, *extra, model=None):
    return train_main(["--model", str(model or i["converted"]), "--data-path", str(i["text"]),
                       "--samples", "4", "--seqlen", "16", "--batch-size", "2", "--no-progress",
                       "--out", str(out), *extra])


def _downcycle(i, out, *extra, model=None):
    return downcycle_main(["--model", str(model or i["dense"]), "--data-path", str(i["articles"]),
                           "--experts", "8", "--active", "4", "--shared-experts", "1", "--calib-tasks", "4",
                           "--layers", "1", "--seqlen", "16", "--steps", "4", "--batch-size", "2",
                           "--warmup", "0", "--out", str(out), *extra])


def _generate(i, out, *extra, model=None):
    """generate writes no directory: `out` is unused, the check is that nothing appears."""
    return generate_main(["--model", str(model or i["converted"]), "--max-new-tokens", "2", *extra])


def _eval(i, out, *extra, model=None):
    return eval_main(["--model", str(model or i["converted"]), "--data-path", str(i["text"]),
                      "--seqlen", "16", "--max-windows", "1", "--no-progress", *extra])


def _latin1_prompts(tmp):
    (tmp / "prompts.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    return str(tmp / "prompts.txt")


def _copy_dense(i, tmp, edit_config=None):
    d = tmp / "copy"
    shutil.copytree(i["dense"], d)
    if edit_config:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(edit_config)
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def _sharded_with_outside_path(i, tmp):
    d = _copy_dense(i, tmp)
    from safetensors.numpy import load_file

    names = list(load_file(str(d / "model.safetensors")))
    (d / "model.safetensors").rename(tmp / "elsewhere.safetensors")
    index = {"metadata": {}, "weight_map": {n: str(tmp / "elsewhere.safetensors") for n in names}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


def _config_a_directory(i, tmp):
    d = _copy_dense(i, tmp)
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    return d


def _integer_weights(i, tmp):
    from safetensors.numpy import load_file, save_file

    d = _copy_dense(i, tmp)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"].astype(np.int32)
    save_file(tensors, str(d / "model.safetensors"))
    return d


def _broken_manifest(i, tmp):
    d = tmp / "conv"
    shutil.copytree(i["converted"], d)
    (d / "cmoe_manifest.json").write_text('{"format": "cmoe_jax.converted/v1", ')
    return d


def _holding_lock(out):
    lock = OutputLock(out)
    lock.acquire()
    return lock


# (id, job, extra flags, model (None: the job's default; or a function of (inputs, tmp)),
#  the message fragment)
CASES = [
    ("convert-out-exists", _convert, ["EXISTS"], None, "exists: pass --overwrite"),
    ("convert-bad-plan", _convert, ["--config", "S1A1E7"], None, "divide"),
    ("convert-seqlen-beyond-context", _convert, ["--seqlen", "100000"], None, "exceeds the model's context"),
    ("convert-missing-data", _convert, ["--data-path", "NONE"], None, "does not exist"),
    ("convert-paper-router-conflict", _convert, ["--paper-router", "--router-neurons", "2"], None,
     "--paper-router sets the router itself"),
    ("convert-out-locked", _convert, ["LOCKED"], None, "is being written by another job (pid"),
    ("convert-partial-not-ours", _convert, ["FOREIGN_PARTIAL", "--resume"], None,
     "was not made by a cmoe_jax job"),
    ("convert-resume-other-settings", _convert, ["STAGED", "--resume", "--seed", "1"], None,
     "different settings (seed: 0 there, 1 now)"),
    ("convert-wrong-shape-as-stored", _convert, [], lambda i, t: _copy_dense(i, t, {"intermediate_size": 128}),
     "down_proj.weight' has shape (32, 64) in the file but the config implies (32, 128)"),
    ("convert-index-outside-dir", _convert, [], _sharded_with_outside_path, "outside the model directory"),
    ("convert-config-json-a-directory", _convert, [], _config_a_directory, "config.json is not a file"),
    ("convert-weights-of-integers", _convert, [], _integer_weights,
     "tensor 'lm_head.weight' holds int32 values where the model has weights"),
    ("convert-out-under-a-file", _convert, ["UNDER_FILE"], None, "is not a directory"),
    ("convert-typo-local-path", _convert, [], lambda i, t: "runs/typo", "it names a local path"),
    ("compress-bad-manifest", _compress, [], _broken_manifest, "cmoe_manifest.json is not valid JSON"),
    ("compress-dense-model", _compress, [], lambda i, t: i["dense"], "has no MoE layers"),
    ("compress-out-exists", _compress, ["EXISTS"], None, "exists: pass --overwrite"),
    ("export-out-exists", _export, ["EXISTS"], None, "exists: pass --overwrite"),
    ("export-out-locked", _export, ["LOCKED"], None, "is being written by another job"),
    ("export-seqlen-beyond-context", _export, ["--calib-samples", "1", "--seqlen", "100000"], None,
     "exceeds the model's context"),
    ("train-out-locked", _train, ["LOCKED"], None, "is being written by another job"),
    ("train-wrong-shape-after-lock", _train, [], lambda i, t: _copy_dense(i, t, {"intermediate_size": 48}),
     "in the file but the config implies"),
    ("train-bad-targets", _train, ["--targets", "nothing_here"], None, "nothing_here"),
    ("export-max-shard-nan", _export, ["--max-shard-mb", "nan"], None, "--max-shard-mb must be a finite number"),
    ("export-max-shard-inf", _export, ["--max-shard-mb", "inf"], None, "--max-shard-mb must be a finite number"),
    ("convert-out-dot", _convert, ["OUT=.", "--overwrite"], None, "names the working directory"),
    ("convert-out-dotdot", _convert, ["OUT=..", "--overwrite"], None, "names the working directory"),
    ("convert-out-empty", _convert, ["OUT=", "--overwrite"], None, "--out must name a path"),
    ("convert-out-not-utf8", _convert, ["OUT=out-\udcff"], None, "is not valid UTF-8"),
    ("eval-out-not-utf8", _eval, ["--json", "r-\udcff.json"], None, "is not valid UTF-8"),
    ("convert-out-is-source", _convert, ["OUT=SOURCE_PARENT", "--overwrite"], lambda i, t: _copy_dense(i, t),
     "is the source model"),
    ("train-out-is-source", _train, ["OUT=SOURCE_PARENT", "--overwrite"], lambda i, t: _copy_dense(i, t),
     "is the source model"),
    ("convert-calib-samples-beyond-text", _convert, ["--calib-samples", "100000"], None,
     "--calib-samples 100000: the calibration data has"),
    ("convert-seqlen-0", _convert, ["--seqlen", "0"], None, "--seqlen must be at least 2"),
    ("convert-lock-is-symlink", _convert, ["LOCK_SYMLINK"], None, "out.lock is a symbolic link"),
    ("generate-temperature-nan", _generate, ["--prompt", "w1", "--temperature", "nan"], None,
     "--temperature must be a finite number"),
    ("generate-prompts-latin1", _generate, ["PROMPTS_LATIN1"], None, "is not UTF-8 text"),
    ("eval-json-in-proc", _eval, ["--json", "/proc/x.json"], None, "--out /proc/x.json cannot be written"),
    ("downcycle-missing-data", _downcycle, ["--data-path", "NONE"], None, "none.txt does not exist: give an existing file"),
    ("downcycle-data-is-a-directory", _downcycle, ["--data-path", "runs"], None,
     "--data-path runs is a directory: give the file itself"),
    ("downcycle-lr-diverges", _downcycle, ["--lr", "1e23"], None, "the loss became nan at step 3: lower --lr"),
    ("downcycle-steps-beyond-text", _downcycle, ["--steps", "2147483647"], None,
     "fewer than --steps x --batch-size = 4294967294"),
    ("convert-calib-samples-overflow", _convert, ["--calib-samples", "100000000000000000000000"], None,
     "--calib-samples must be at most 9223372036854775807 (a 64-bit integer)"),
    ("train-seed-overflow", _train, ["--seed", "100000000000000000000000"], None,
     "--seed must be at most 4294967295"),
    ("train-recover-steps-overflow", _train, ["--recover", "layerwise", "--recover-steps", "1e23"], None,
     "--recover-steps: '1e23' is not an integer"),
    ("train-lora-rank-beyond-the-weights", _train, ["--lora-rank", "100000000000000000000000"], None,
     "--lora-rank must be at most"),
    ("train-lora-rank-beyond-full-rank", _train, ["--lora-rank", "33"], None,
     "--lora-rank 33 exceeds the rank of every adapted weight (at most 32)"),
    ("train-lora-alpha-huge", _train, ["--lora-alpha", "1e23"], None,
     "--lora-alpha 1e+23 with --lora-rank 8 scales the adapters' update by 1.25e+22"),
    ("train-kd-temperature-huge", _train, ["--distill", "--kd-temperature", "1e23"], None,
     "--kd-temperature must be at most"),
    ("train-recover-lr-diverges", _train, ["--recover", "layerwise", "--recover-samples", "2", "--recover-lr",
                                           "1e23"], None, "the layer-wise fit diverged (its error became nan): lower --recover-lr"),
    ("export-max-shard-huge", _export, ["--max-shard-mb", "1e308"], None, "--max-shard-mb must be at most"),
    ("generate-top-k-overflow", _generate, ["--prompt", "w1", "--top-k", "100000000000000000000"], None,
     "--top-k must be at most"),
    ("generate-top-k-beyond-vocab", _generate, ["--prompt", "w1", "--top-k", "97"], None,
     "--top-k 97 exceeds the model's vocabulary of 96 tokens"),
    ("generate-seed-overflow", _generate, ["--prompt", "w1", "--seed", "100000000000000000000"], None,
     "--seed must be at most 4294967295"),
    ("generate-prompts-file-directory", _generate, ["--prompts-file", "runs"], None,
     "--prompts-file runs is a directory: give the file itself"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_nothing_written(inputs, tmp_path, capsys, monkeypatch, case):
    _, job, extra, model, message = case
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    out = tmp_path / "out"
    flags, lock, staged = [], None, False
    for flag in extra:
        if flag == "EXISTS":
            out.mkdir()
            (out / "user_file").write_text("keep me")
        elif flag == "LOCKED":
            lock = _holding_lock(out)
        elif flag == "FOREIGN_PARTIAL":
            (tmp_path / "out.partial").mkdir()
            (tmp_path / "out.partial" / "user_file").write_text("keep me")
        elif flag == "STAGED":
            convert(str(inputs["dense"]), _tiny_job(inputs["text"]), out=out, progress=False,
                    stop_after_layers=1)
            staged = True
        elif flag == "UNDER_FILE":
            (tmp_path / "afile").write_text("x")
            out = tmp_path / "afile" / "out"
        elif flag == "NONE":
            flags.append(str(tmp_path / "none.txt"))
        elif flag.startswith("OUT="):
            out = flag[4:] if flag[4:] != "SOURCE_PARENT" else tmp_path / "copy"
        elif flag == "LOCK_SYMLINK":
            (tmp_path / "victim").write_text("another user's")
            (tmp_path / "out.lock").symlink_to(tmp_path / "victim")
        elif flag == "PROMPTS_LATIN1":
            flags += ["--prompts-file", _latin1_prompts(tmp_path)]
        else:
            flags.append(flag)
    before = sorted(p.name for p in tmp_path.iterdir()
                    if not (p.name == "out.lock" and lock is not None))  # ours, released below
    partial_before = sorted(str(p) for p in (tmp_path / "out.partial").rglob("*")) if staged else None
    capsys.readouterr()
    try:
        code = job(inputs, out, *flags, model=model(inputs, tmp_path) if model else None)
    finally:
        if lock is not None:
            lock.release()
    # a progress bar cleared with "\r" before the error shares its line on a terminal only
    err = [line.split("\r")[-1] for line in capsys.readouterr().err.strip().split("\n")]
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert message in err[0], err[0]
    after = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("copy", "conv", "elsewhere.safetensors"))
    assert after == [n for n in before if n not in ("copy", "conv", "elsewhere.safetensors")]
    if "EXISTS" in extra:
        assert (out / "user_file").read_text() == "keep me"
    if "LOCK_SYMLINK" in extra:
        assert (tmp_path / "victim").read_text() == "another user's"
    if "FOREIGN_PARTIAL" in extra:
        assert (tmp_path / "out.partial" / "user_file").read_text() == "keep me"
    if staged:  # the staged work is kept, untouched, for a resume with the right settings
        assert sorted(str(p) for p in (tmp_path / "out.partial").rglob("*")) == partial_before
    _record(case, err[0].replace(str(tmp_path), "."))


TABLE_ENV = "CMOE_BAD_INPUT_TABLE"  # scripts/bad_input_table.py: where each passing case is recorded


def _record(case, line: str) -> None:
    """Append a passing case (its id, flags and one line) for the docs' table."""
    if os.environ.get(TABLE_ENV):
        with open(os.environ[TABLE_ENV], "a") as f:
            f.write(json.dumps({"id": case[0], "job": case[1].__name__.strip("_"), "flags": case[2],
                                "error": line}) + "\n")


def test_export_resume_refuses_a_changed_source(inputs, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(inputs["converted"], src)
    settings = ExportSettings(calib_samples=0, max_shard_mb=0.01)
    assert export(str(src), settings, out=tmp_path / "hf", stop_after_shards=2, progress=False)["out"] is None
    manifest = json.loads((src / "cmoe_manifest.json").read_text())
    (src / "cmoe_manifest.json").write_text(json.dumps(sealed(dict(manifest, note="edited"))))  # new content
    capsys.readouterr()
    assert _export(inputs, tmp_path / "hf", "--resume", "--max-shard-mb", "0.01", model=src) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the source model changed" in err[0], err
    assert not (tmp_path / "hf").exists()


def test_corrupt_orbax_state_is_one_short_line(inputs, tmp_path):
    bad = tmp_path / "conv"
    shutil.copytree(inputs["converted"], bad)
    for f in (bad / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 64:
            f.write_bytes(f.read_bytes()[:32])
    proc = subprocess.run([sys.executable, "-m", "cmoe_jax.export", "--model", str(bad), "--out",
                           str(tmp_path / "hf"), "--calib-samples", "0", "--no-progress"],
                          capture_output=True, text=True, cwd=ROOT, env=dict(os.environ))
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and len(err[0]) < 600, proc.stderr[-3000:]
    assert str(bad / "state") in err[0] and "Event loop is closed" not in proc.stderr
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()


def test_unexpected_errors_keep_their_traceback():
    def job(_):
        raise ValueError("a bug, not bad input")

    with pytest.raises(ValueError, match="a bug"):
        run_job(job, None)


def test_overwrite_publish_leaves_siblings_alone(inputs, tmp_path):
    out = tmp_path / "out"
    assert _export(inputs, out) == 0
    sibling = tmp_path / "out.old"
    sibling.mkdir()
    (sibling / "mine").write_text("the user's")
    assert _export(inputs, out, "--overwrite") == 0
    assert (sibling / "mine").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.old"]


def test_kill_between_the_renames_of_overwrite_is_repaired(inputs, tmp_path, capsys):
    out = tmp_path / "out"
    assert _export(inputs, out) == 0
    before = (out / "cmoe_export.json").read_text()
    proc = subprocess.run([sys.executable, "-m", "cmoe_jax.export", "--model", str(inputs["converted"]),
                           "--out", str(out), "--calib-samples", "0", "--no-progress", "--overwrite"],
                          capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, CMOE_FAULT_AT="publish:swap:1"))
    assert proc.returncode == -9 and not out.exists(), proc.stderr[-2000:]
    capsys.readouterr()
    assert _export(inputs, out) == 2  # the next job on it puts the old output back first
    assert "exists" in capsys.readouterr().err
    assert (out / "cmoe_export.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.partial"]  # kept for --resume


def test_failure_after_staging_leaves_no_partial_and_next_run_works(inputs, tmp_path):
    out = tmp_path / "ft"
    broken = _copy_dense(inputs, tmp_path, {"intermediate_size": 48})
    assert _train(inputs, out, model=broken) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]
    assert _train(inputs, out, "--max-steps", "1") == 0


def test_export_that_reads_back_differently_fails(inputs, tmp_path):
    """Our model against another model's export: far beyond the tolerance."""
    other = tmp_path / "other"
    tiny_hf_model("llama", intermediate_size=64, num_hidden_layers=1).save_pretrained(other)
    ours = load_model(str(inputs["dense"]), progress=False).model
    windows = np.random.default_rng(0).integers(0, 96, (1, 16)).astype(np.int32)
    check = compare_with_transformers(ours, other, windows)
    with pytest.raises(ExportError, match="not published"):
        require_match(check)
    same = compare_with_transformers(ours, inputs["dense"], windows)
    assert require_match(same)["max_abs_logit_diff"] <= require_match(same)["tolerance"]

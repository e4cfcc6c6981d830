"""What an adversarial user tried on the job layer, each as a test: a resume never mixes two
texts, a job touches only paths it created and recorded, a symbolic link at the lock is
never written through, a reader never sees a mix of two models, loading verifies what it
reads, an export's half-written shard and a train's moved checkpoints survive a kill.

Kills are real (SIGKILL from the `CMOE_FAULT_AT` hook in a child process); the reader race
is made deterministic by pausing the reader between two layers (`CMOE_FAULT_PAUSE`)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import pytest

from cmoe_jax.checkpoint import MANIFEST, restore_model
from cmoe_jax.checkpoint.seal import sealed
from cmoe_jax.convert import convert
from cmoe_jax.errors import CheckpointError
from cmoe_jax.jobs import OutputDir, ResumeMismatchError, fingerprint
from tests.conftest import write_random_text
from tests.test_bad_input import _convert, _export, _tiny_job, _train, inputs  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]


def _run(module: str, *args, env=None):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, **(env or {})))


def _leaves(model):
    from flax import nnx

    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(model))]


# ---- 1. a resume never mixes two calibration texts -------------------------------------------

def test_resume_after_the_data_file_changed_is_refused(inputs, tmp_path):
    text = tmp_path / "v.txt"
    shutil.copy(inputs["text"], text)
    out = tmp_path / "out"
    convert(str(inputs["dense"]), _tiny_job(text), out=out, progress=False, stop_after_layers=1)
    write_random_text(text, 3000, seed=5)  # same path, other content
    with pytest.raises(ResumeMismatchError, match="calibration or training text differs"):
        convert(str(inputs["dense"]), _tiny_job(text), out=out, progress=False, resume=True)
    assert not out.exists() and (tmp_path / "out.partial" / "layers" / "0000.json").exists()


def test_train_resume_after_the_data_file_changed_is_refused(inputs, tmp_path, capsys):
    text = tmp_path / "t.txt"
    shutil.copy(inputs["text"], text)
    out = tmp_path / "ft"
    proc = _run("cmoe_jax.train", "--model", inputs["converted"], "--data-path", text, "--samples", 4,
                "--seqlen", 16, "--batch-size", 2, "--no-progress", "--save-every", 1, "--out", out,
                env={"CMOE_FAULT_AT": "checkpoint:1"})
    assert proc.returncode == -9, proc.stderr[-2000:]
    write_random_text(text, 3000, seed=6)
    code = _train(inputs, out, "--resume", "--data-path", str(text))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "training text differs" in err[0], err


def test_the_manifest_records_the_inputs_by_content(inputs):
    manifest = json.loads((inputs["converted"] / MANIFEST).read_text())
    digests = manifest["inputs"]
    assert len(digests["data_sha256"]) == 64 and len(digests["source_sha256"]) == 64
    assert digests["source_bytes"] == sum(p.stat().st_size for p in inputs["dense"].rglob("*")
                                          if p.is_file() and not any(s.startswith(".") for s in p.parts[-2:]))


def test_same_path_same_times_other_content_is_another_source(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 64)
    before = fingerprint("x", {}, f)
    st = f.stat()
    f.write_bytes(b"b" * 64)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as before
    assert fingerprint("x", {}, f)["source"] != before["source"]


# ---- 2. nothing outside one's own paths ---------------------------------------------------------

def test_bad_input_leaves_look_alike_siblings_alone(inputs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name in (".out.old-mine", ".out.new-mine", ".out.trash-mine"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "keep").write_text("the user's")
    (tmp_path / ".out.old-mine" / "out").mkdir()  # looks like an old output moved aside
    assert _convert(inputs, tmp_path / "out", "--data-path", str(tmp_path / "none.txt")) == 2
    assert "does not exist" in capsys.readouterr().err
    for name in (".out.old-mine", ".out.new-mine", ".out.trash-mine"):
        assert (tmp_path / name / "keep").read_text() == "the user's"
    assert (tmp_path / ".out.old-mine" / "out").is_dir() and not (tmp_path / "out").exists()
    assert _convert(inputs, tmp_path / "out") == 0  # nor does a job that succeeds
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.new-mine", ".out.old-mine",
                                                          ".out.trash-mine", "out"]


def test_a_symlink_at_the_lock_is_never_written_through(inputs, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("another user's file")
    (tmp_path / "out.lock").symlink_to(victim)
    assert _convert(inputs, tmp_path / "out", "--data-path", str(tmp_path / "none.txt")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "out.lock is a symbolic link" in err[0], err
    assert victim.read_text() == "another user's file" and (tmp_path / "out.lock").is_symlink()


def test_a_symlink_at_the_staging_path_is_refused(inputs, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("x")
    (tmp_path / "out.partial").symlink_to(elsewhere)
    assert _export(inputs, tmp_path / "out") == 2
    assert "is a symbolic link" in capsys.readouterr().err
    assert (elsewhere / "keep").read_text() == "x"


@pytest.mark.parametrize("point", ["publish:swap:1", "published:swap:1", "cleanup:2", "discarded:1"])
def test_kill_inside_publish_or_cleanup_is_repaired_by_a_plain_rerun(inputs, tmp_path, point):
    out = tmp_path / "out"
    assert _export(inputs, out) == 0
    before = (out / "config.json").read_text()
    proc = _run("cmoe_jax.export", "--model", inputs["converted"], "--out", out, "--calib-samples", 0,
                "--no-progress", "--overwrite", env={"CMOE_FAULT_AT": point})
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert _export(inputs, out, "--overwrite") == 0
    assert (out / "config.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---- 4. a reader sees the old model or the new one, never a mix -----------------------------------

def _read_during_publish(inputs, tmp_path, monkeypatch):
    """A reader of `old` paused after its first layer, an overwrite publish of `new` let run
    up to 2 s, the reader resumed: (old's arrays, new's arrays, what the reader got: its
    arrays, or the CheckpointError it raised)."""
    from cmoe_jax import faults

    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(inputs["converted"], old)
    convert(str(inputs["dense"]), _tiny_job(write_random_text(tmp_path / "t.txt", 3000, seed=9)),
            out=new, progress=False)
    before, after = _leaves(restore_model(old)), _leaves(restore_model(new))
    gate = tmp_path / "gate"
    gate.mkdir()
    faults.reset_counts()
    monkeypatch.setenv(faults.PAUSE_ENV, f"read:layer:2:{gate}")  # after layer 0, before layer 1
    result = {}

    def read():
        try:
            result["model"] = restore_model(old)
        except CheckpointError as e:
            result["error"] = e

    reader = threading.Thread(target=read)
    reader.start()
    while not (gate / "paused").exists() and reader.is_alive():
        reader.join(0.01)
    assert (gate / "paused").exists(), "the reader did not pause between its layers"

    def publish():
        with OutputDir(old, "test-publish", overwrite=True) as job:
            job.open(fingerprint("test-publish", {}, None))
            shutil.copytree(new, job.staging.dir / "final")
            job.publish(job.staging.dir / "final")

    writer = threading.Thread(target=publish)
    writer.start()
    writer.join(2.0)  # without the readers' lock the publish completes here
    (gate / "go").touch()
    reader.join()
    writer.join()
    monkeypatch.delenv(faults.PAUSE_ENV)
    assert all(np.array_equal(a, b) for a, b in zip(after, _leaves(restore_model(old))))  # published
    return before, after, result.get("error") or _leaves(result["model"])


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def test_a_reader_is_isolated_from_an_overwrite_publish(inputs, tmp_path, monkeypatch):
    before, after, got = _read_during_publish(inputs, tmp_path, monkeypatch)
    assert not _same(before, after) and _same(got, before)


def test_without_the_readers_lock_the_same_schedule_gives_a_mix(inputs, tmp_path, monkeypatch):
    """The test above can fail: with the lock taken out, the reader reads layers of both, which
    the old manifest's checksums refuse (without checksums, as in older directories, it would
    return the mix)."""
    import contextlib

    import cmoe_jax.jobs.staging as staging

    monkeypatch.setattr(staging, "readers_excluded", lambda _: contextlib.nullcontext())
    before, after, got = _read_during_publish(inputs, tmp_path, monkeypatch)
    assert isinstance(got, CheckpointError), "the reader returned a model"
    assert "state/layer_0001: " in str(got) and "does not match the checksum" in str(got)


# ---- 5. loading verifies what it reads ---------------------------------------------------------

def _copy_converted(inputs, tmp_path, name="conv"):
    d = tmp_path / name
    shutil.copytree(inputs["converted"], d)
    return d


def test_manifest_layer_count_disagreeing_with_the_state_is_refused(inputs, tmp_path):
    d = _copy_converted(inputs, tmp_path)
    manifest = json.loads((d / MANIFEST).read_text())
    manifest["model_config"]["num_layers"] -= 1
    (d / MANIFEST).write_text(json.dumps(sealed(manifest)))  # resealed: the check below the seal's
    with pytest.raises(CheckpointError, match="describes 1 layers but state/ holds 2 layer states"):
        restore_model(d)


def test_a_layer_state_linked_outside_the_directory_is_refused(inputs, tmp_path):
    d, other = _copy_converted(inputs, tmp_path), _copy_converted(inputs, tmp_path, "other")
    shutil.rmtree(d / "state" / "layer_0001")
    (d / "state" / "layer_0001").symlink_to(other / "state" / "layer_0001")
    with pytest.raises(CheckpointError, match="leads outside the model directory"):
        restore_model(d)


def test_a_layer_state_of_another_shape_is_refused(inputs, tmp_path, save_tiny):
    d = _copy_converted(inputs, tmp_path)
    manifest = json.loads((d / MANIFEST).read_text())
    manifest["model_config"]["hidden_size"] = 64
    (d / MANIFEST).write_text(json.dumps(sealed(manifest)))  # resealed: the check below the seal's
    with pytest.raises(CheckpointError):
        restore_model(d)


# ---- 7, 8. the export's and train's windows ---------------------------------------------------

def test_a_half_written_shard_is_never_published(inputs, tmp_path):
    out = tmp_path / "hf"
    proc = _run("cmoe_jax.export", "--model", inputs["converted"], "--out", out, "--calib-samples", 0,
                "--no-progress", "--max-shard-mb", "0.01", env={"CMOE_FAULT_AT": "shard:write:3"})
    assert proc.returncode == -9, proc.stderr[-2000:]
    (tmp_path / "hf.partial" / "final" / ".tmpab12cd").write_bytes(b"half a shard")  # any stray file
    assert _export(inputs, out, "--resume", "--max-shard-mb", "0.01") == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(set(index["weight_map"].values()))
    assert not list(out.glob(".tmp*")) and not list(out.glob("*.tmp"))
    assert all((p.stat().st_mode & 0o777) == 0o644 for p in out.glob("*.safetensors"))


def test_train_killed_before_publish_resumes_from_its_last_step(inputs, tmp_path):
    out = tmp_path / "ft"
    flags = ["--model", inputs["converted"], "--data-path", inputs["text"], "--samples", 4, "--seqlen", 16,
             "--batch-size", 2, "--no-progress", "--out", out]
    proc = _run("cmoe_jax.train", *flags, env={"CMOE_FAULT_AT": "publish:1"})
    assert proc.returncode == -9 and (tmp_path / "ft.partial" / "final" / "checkpoints").is_dir()
    proc = _run("cmoe_jax.train", *flags, "--resume")
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = json.loads((out / "train_log.json").read_text())
    assert log["resumed_from"] == len(log["steps"]) == 2


# ---- 9, 10. every failure one line; `~` expanded where it is checked and written -----------------

def test_disk_full_in_the_staging_directory_is_one_line_and_keeps_the_work(inputs, tmp_path, capsys,
                                                                           monkeypatch):
    import errno

    import cmoe_jax.jobs.progress as progress

    real, calls = progress.write_json_atomic, []

    def full_after_one_layer(path, obj):
        calls.append(path)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, obj)

    monkeypatch.setattr(progress, "write_json_atomic", full_after_one_layer)
    out = tmp_path / "out"
    assert _convert(inputs, out, "--no-progress") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: No space left on device at ") and "--resume" in err[0]
    monkeypatch.setattr(progress, "write_json_atomic", real)
    assert (tmp_path / "out.partial" / "layers" / "0000.json").exists() and not out.exists()
    assert _convert(inputs, out, "--resume") == 0 and out.is_dir()


def test_tilde_is_expanded_where_the_output_is_checked_and_written(monkeypatch, tmp_path):
    from cmoe_jax.cli_args import Parser, add_output_dir, add_output_json

    monkeypatch.setenv("HOME", str(tmp_path))
    p = Parser("x", "x", "x")
    add_output_dir(p, "x")
    assert p.parse_args(["--out", "~/model"]).out == str(tmp_path / "model")
    p = Parser("y", "y", "y")
    add_output_json(p)
    assert p.parse_args(["--json", "~/r.json"]).out == str(tmp_path / "r.json")


def test_a_resume_drops_the_temporary_of_a_json_write_killed_midway(tmp_path):
    """A kill inside `write_json_atomic` leaves `.NAME.XXXX.tmp` in the staging directory;
    the resumed job must not carry it into its published output."""
    out = tmp_path / "out"
    fp = fingerprint("x", {"a": 1}, None)
    with OutputDir(out, "x") as job:
        job.open(fp)
        (job.staging.dir / "final").mkdir()
        (job.staging.dir / "final" / ".train_log.json.abc123.tmp").write_text("{")
        (job.staging.dir / "final" / "kept.json").write_text("{}")
    with OutputDir(out, "x", resume=True) as job:
        assert job.open(fp)
        left = sorted(p.name for p in (job.staging.dir / "final").iterdir())
        assert left == ["kept.json"], left

"""Inputs that change under a job are detected, never mixed: continuing a finished training
run checks the text and the source by content as a resume does; a source replaced or
written while a job runs stops the job before it publishes; a job holds the readers' lock of
its source, an exported Hugging Face directory included, so an overwrite of that source
waits for the job."""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cmoe_jax.checkpoint import reading
from tests.conftest import write_random_text
from tests.test_bad_input import _export, _train, inputs  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def finished(inputs, tmp_path_factory):
    """A finished training run (1 of its 2 steps: stopped by --max-steps) of the converted model
    on a copy of the text."""
    root = tmp_path_factory.mktemp("finished")
    text, conv = root / "t.txt", root / "conv"
    shutil.copy(inputs["text"], text)
    shutil.copytree(inputs["converted"], conv)
    assert _train(inputs, root / "ft", "--data-path", str(text), "--max-steps", "1", model=conv) == 0
    return {"text": text, "conv": conv, "ft": root / "ft"}


def _continue(inputs, run, tmp_path):
    """Continue a copy of the finished run in place (the copy keeps the module's run intact)."""
    out = tmp_path / "ft"
    shutil.copytree(run["ft"], out)
    before = sorted((str(p.relative_to(out)), p.stat().st_size) for p in out.rglob("*"))
    code = _train(inputs, out, "--resume", "--data-path", str(run["text"]), model=run["conv"])
    return code, out, before


def test_continuing_a_finished_run_on_a_changed_text_is_refused(inputs, finished, tmp_path, capsys):
    original = finished["text"].read_bytes()
    write_random_text(finished["text"], 3000, seed=9)  # same path, other content
    try:
        code, out, before = _continue(inputs, finished, tmp_path)
    finally:
        finished["text"].write_bytes(original)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "training text differs" in err[0], err
    assert sorted((str(p.relative_to(out)), p.stat().st_size) for p in out.rglob("*")) == before
    assert not (tmp_path / "ft.partial").exists()


def test_continuing_a_finished_run_from_a_changed_source_is_refused(inputs, finished, tmp_path, capsys):
    note = finished["conv"] / "notes.txt"
    note.write_text("a file added to the source model")
    try:
        code, _, _ = _continue(inputs, finished, tmp_path)
    finally:
        note.unlink()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "source model changed" in err[0], err


def test_continuing_a_finished_run_on_the_same_inputs_still_works(inputs, finished, tmp_path):
    code, out, _ = _continue(inputs, finished, tmp_path)
    assert code == 0 and (out / "cmoe_manifest.json").is_file()


def _paused_convert(inputs, source, out, pause_dir, *flags):
    pause_dir.mkdir()
    return subprocess.Popen(
        [sys.executable, "-m", "cmoe_jax.convert", "--model", str(source), "--data-path", str(inputs["text"]),
         "--calib-samples", "2", "--seqlen", "32", "--k-act", "4", "--config", "S1A1E8", "--no-progress",
         "--out", str(out), *flags],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, CMOE_FAULT_PAUSE=f"layer:1:{pause_dir}"))


def _wait(path: Path, proc) -> None:
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False])
def test_a_source_replaced_while_the_job_runs_is_never_published(inputs, tmp_path, stream):
    source, other = tmp_path / "src", tmp_path / "other"
    shutil.copytree(inputs["dense"], source)
    shutil.copytree(inputs["dense"], other)
    (other / "config.json").write_text((other / "config.json").read_text().replace("{", '{"note": 1, ', 1))
    proc = _paused_convert(inputs, source, tmp_path / "out", tmp_path / "pause", *(["--stream"] if stream else []))
    _wait(tmp_path / "pause" / "paused", proc)
    source.rename(tmp_path / "src.old")  # replaced as `export --overwrite` or a copy would
    other.rename(source)
    (tmp_path / "pause" / "go").touch()
    _, err = proc.communicate(timeout=600)
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "changed while the job ran" in lines[0], err[-2000:]
    assert not (tmp_path / "out").exists()


def test_a_job_holds_the_readers_lock_of_an_exported_source(inputs, tmp_path):
    exported = tmp_path / "hf"
    assert _export(inputs, exported) == 0
    record = os.open(exported / "cmoe_export.json", os.O_RDONLY)
    try:
        with reading(exported):  # what a job on this source holds while it runs
            with pytest.raises(BlockingIOError):  # so an overwrite's publish would wait
                fcntl.flock(record, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(record, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free once the job is done
    finally:
        os.close(record)


def test_new_data_continues_a_finished_run_and_records_it(inputs, finished, tmp_path, capsys):
    import json

    other = tmp_path / "other.txt"
    write_random_text(other, 3000, seed=11)
    out = tmp_path / "ft"
    shutil.copytree(finished["ft"], out)
    steps = len(json.loads((out / "train_log.json").read_text())["steps"])
    assert _train(inputs, out, "--data-path", str(other), "--new-data", model=finished["conv"]) == 2
    assert "--new-data does not apply without --resume" in capsys.readouterr().err
    assert _train(inputs, out, "--resume", "--data-path", str(other), "--new-data", model=finished["conv"]) == 0
    log = json.loads((out / "train_log.json").read_text())
    history = log["data_history"]
    assert [h["from_step"] for h in history] == [0, steps] and len(log["steps"]) == steps + 1
    assert history[0]["data_path"] == str(finished["text"]) and history[1]["data_path"] == str(other)
    manifest = json.loads((out / "cmoe_manifest.json").read_text())
    assert manifest["inputs"]["data_sha256"] == history[1]["data_sha256"] != history[0]["data_sha256"]

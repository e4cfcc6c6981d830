"""Paths a job did not create are never damaged: whatever a user left at `OUT.lock` (a plain
file, a hard link to one, a FIFO, a directory, a symbolic link) is refused and left exactly
as it is, even on bad input; a dead job's lock (its record, or empty) is taken over and
removed; an output holding symbolic links to directories, or `--out` itself a link, is
replaced without following them; a job killed after publishing is cleaned up by the next
job on that output, even one refused because the output exists."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cmoe_jax.jobs import OutputLock, lock_path
from cmoe_jax.jobs.lock import MARKER, OutputPlaceError
from tests.test_bad_input import _convert, _export, inputs  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]


def _foreign_lock(kind: str, tmp: Path) -> tuple[Path, object]:
    """A user's thing at `tmp/out.lock`; returns (lock path, how to read it back unchanged)."""
    lock = tmp / "out.lock"
    victim = tmp / "victim.txt"
    victim.write_text("another user's file")
    if kind == "plain":
        lock.write_text('{"pid": 1, "note": "mine"}')
    elif kind == "hardlink":
        os.link(victim, lock)
    elif kind == "hardlinked-record":  # even a lock record, if the file has another name
        victim.write_text(json.dumps({"marker": MARKER, "pid": 1, "paths": []}))
        os.link(victim, lock)
    elif kind == "fifo":
        os.mkfifo(lock)
    elif kind == "directory":
        lock.mkdir()
        (lock / "keep").write_text("x")
    return lock, lambda: (victim.read_text(), sorted(os.listdir(tmp)),
                          os.lstat(lock).st_mode, os.lstat(lock).st_nlink,
                          lock.read_text() if lock.is_file() else None)


@pytest.mark.parametrize("kind", ["plain", "hardlink", "hardlinked-record", "fifo", "directory"])
def test_a_foreign_file_at_the_lock_is_refused_and_left_as_it_is(inputs, tmp_path, capsys, kind):
    lock, state = _foreign_lock(kind, tmp_path)
    before = state()
    for bad in ([], ["--data-path", str(tmp_path / "none.txt")]):  # a good job and a bad input
        assert _convert(inputs, tmp_path / "out", *bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(lock) in err[0], err
        assert state() == before and not (tmp_path / "out").exists()


def test_a_dead_jobs_lock_is_taken_over_and_removed(inputs, tmp_path):
    out = tmp_path / "out"
    lock_path(out).write_text(json.dumps({"marker": MARKER, "run": "dead", "pid": 1, "paths": []}))
    assert _convert(inputs, out) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_empty_lock_left_by_a_kill_before_its_record_is_taken_over(inputs, tmp_path):
    out = tmp_path / "out"
    lock_path(out).touch()
    assert _convert(inputs, out) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_lock_that_cannot_be_recorded_is_removed(tmp_path, monkeypatch):
    """A full disk refuses the record: the file made for it does not stay behind, empty."""
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="No space"):
        OutputLock(tmp_path / "out").acquire()
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_a_lock_replaced_under_its_holder_is_not_removed_by_it(tmp_path):
    """Release removes only the file it locked, carrying its own run id."""
    lock = OutputLock(tmp_path / "out").acquire()
    lock.path.unlink()
    lock.path.write_text("a user's file, put there while the job ran")
    lock.release()
    assert lock.path.read_text() == "a user's file, put there while the job ran"


def test_refusal_names_the_place_error_type(tmp_path):
    (tmp_path / "out.lock").write_text("not json")
    with pytest.raises(OutputPlaceError, match="no cmoe_jax job wrote"):
        OutputLock(tmp_path / "out").acquire()
    assert (tmp_path / "out.lock").read_text() == "not json"


@pytest.mark.parametrize("layout", ["out-is-a-link", "output-holds-a-link"])
def test_overwrite_never_follows_links_to_directories(inputs, tmp_path, layout):
    target = tmp_path / "elsewhere"
    (target / "sub").mkdir(parents=True)
    (target / "sub" / "keep").write_text("the user's")
    out = tmp_path / "out"
    if layout == "out-is-a-link":
        out.symlink_to(target)
    else:
        assert _export(inputs, out) == 0
        (out / "link").symlink_to(target)
    assert _export(inputs, out, "--overwrite") == 0
    assert (target / "sub" / "keep").read_text() == "the user's"
    assert out.is_dir() and not out.is_symlink() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "out"]


def test_a_dangling_symlink_out_is_refused_before_any_work(inputs, tmp_path, capsys):
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "gone")
    assert _export(inputs, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "symbolic link" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and out.is_symlink()


def test_leftovers_of_a_kill_after_publishing_are_cleared_by_a_refused_rerun(inputs, tmp_path, capsys):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "cmoe_jax.export", "--model", str(inputs["converted"]),
                           "--out", str(out), "--calib-samples", "0", "--no-progress"],
                          capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, CMOE_FAULT_AT="cleanup:2"))
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert any(p.name.startswith(".out.trash-") for p in tmp_path.iterdir())
    assert _export(inputs, out) == 2  # refused: the output exists ...
    assert "exists" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # ... and the leftovers are gone


# ---- a job never writes inside, over or around its inputs ------------------------------------------

def _inside_cases(i, tmp):
    """(job, flags, where the refusal points): every one a path the job would have damaged."""
    from tests.test_bad_input import _eval, _train

    conv = tmp / "conv"
    import shutil

    shutil.copytree(i["converted"], conv)
    dense = tmp / "dense"
    shutil.copytree(i["dense"], dense)
    text = tmp / "data" / "t.txt"
    text.parent.mkdir()
    shutil.copy(i["text"], text)
    return conv, [
        (_export, (conv / "state", "--overwrite"), dict(model=conv)),
        (_export, (conv, "--overwrite"), dict(model=conv)),
        (_convert, (dense / "sub",), dict(model=dense)),
        (_convert, (tmp / "data", "--overwrite"), dict(model=dense)),  # would replace the data's directory
        (_train, (conv / "ft",), dict(model=conv)),
        (_eval, (None, "--json", str(conv / "cmoe_manifest.json")), dict(model=conv)),
        (_eval, (None, "--json", str(text), "--data-path", str(text)), dict(model=conv)),
    ]


def test_a_job_never_writes_inside_over_or_around_its_inputs(inputs, tmp_path, capsys):
    conv, cases = _inside_cases(inputs, tmp_path)
    snapshot = lambda: sorted((str(p.relative_to(tmp_path)), p.stat().st_size, p.stat().st_mtime_ns)  # noqa: E731
                              for p in tmp_path.rglob("*"))
    before = snapshot()
    for job, (out, *extra), kw in cases:
        if job.__name__ == "_convert":
            extra = [*extra, "--data-path", str(tmp_path / "data" / "t.txt")]
        assert job(inputs, out, *extra, **kw) == 2, (job.__name__, out, extra)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "never writes over, inside or around" in err[0], err
        assert snapshot() == before, (job.__name__, out, extra)

"""Every spelling of one place is that place: `--out` given as a symbolic link to an input, as a
relative path climbing out with `..` to it, or through a symbolically linked parent, is
refused with one `error:` line before any lock is taken, and the input is left as it was.

Each job runs its real CLI in a child process with a time limit, so a job that waits on a
lock it holds itself (an overwrite publishing over its own source) fails the test instead
of hanging it."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cmoe_jax.checkpoint import readers_excluded, reading
from cmoe_jax.errors import CheckpointError
from tests.test_bad_input import inputs  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]
SPELLINGS = ("link", "dotdot", "linked-parent")
LIMIT_S = 300  # a child that is still running after this waits on something (a normal run: seconds)

# each case runs the command's `main` in one child, one JSON line per case
DRIVER = """
import contextlib, importlib, io, json, sys
for job, argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = importlib.import_module(f"cmoe_jax.{job}.cli").main(argv)
    print(json.dumps({"code": code, "err": err.getvalue()}), flush=True)
"""


def _argv(job: str, i: dict, out: str) -> list[str]:
    """The job's smallest run on the suite's tiny models, writing `out` (with --overwrite)."""
    data = ["--data-path", str(i["text"])]
    return {
        "convert": ["--model", str(i["dense"]), *data, "--calib-samples", "2", "--seqlen", "32",
                    "--k-act", "4", "--config", "S1A1E8"],
        "compress": ["--model", str(i["converted"]), *data, "--calib-samples", "2", "--seqlen", "32",
                     "--method", "conmoe", "--ratio", "0.5"],
        "export": ["--model", str(i["converted"]), "--calib-samples", "0", "--no-progress"],
        "train": ["--model", str(i["converted"]), *data, "--samples", "4", "--seqlen", "16",
                  "--batch-size", "2", "--no-progress"],
        "downcycle": ["--model", str(i["dense"]), "--data-path", str(i["articles"]), "--experts", "8",
                      "--active", "4", "--shared-experts", "1", "--calib-tasks", "4", "--layers", "1",
                      "--seqlen", "16", "--steps", "4", "--batch-size", "2", "--warmup", "0"],
        "eval": ["--model", str(i["converted"]), *data, "--seqlen", "16", "--max-windows", "1",
                 "--no-progress"],
    }[job] + ["--out", out] + ([] if job == "eval" else ["--overwrite"])


def _victim(job: str, i: dict) -> Path:
    """The input `--out` is made to name: the model a job reads (eval's `--out` is a JSON file:
    its data file)."""
    return Path(i["text"] if job == "eval" else i["dense"] if job in ("convert", "downcycle")
                else i["converted"])


def _spelled(kind: str, target: Path, tmp: Path, cwd: Path) -> str:
    """`target` spelled as `kind`, from the child's working directory `cwd`."""
    if kind == "link":
        link = tmp / f"link-to-{target.name}"
        link.symlink_to(target)
        return str(link)
    if kind == "dotdot":
        path = os.path.relpath(target, cwd)
        assert path.startswith("..")
        return path
    parent = tmp / f"parent-of-{target.name}"
    parent.symlink_to(target.parent)
    return str(parent / target.name)


def _tree_digest(path: Path) -> str:
    """Names, kinds and contents of everything under `path` (or of the file itself)."""
    h = hashlib.sha256()
    for p in sorted([path, *path.rglob("*")] if path.is_dir() else [path]):
        h.update(str(p.relative_to(path.parent)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("job", ["convert", "compress", "export", "train", "downcycle", "eval"])
def test_out_spelled_as_an_input_is_refused_without_waiting(inputs, tmp_path, job):  # noqa: F811
    cwd = tmp_path / "runs"
    cwd.mkdir()
    victim = _victim(job, inputs)
    before = _tree_digest(victim)
    cases = [(job, _argv(job, inputs, _spelled(kind, victim, tmp_path, cwd))) for kind in SPELLINGS]
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(cases)], cwd=cwd, capture_output=True,
                          text=True, timeout=LIMIT_S,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(SPELLINGS), proc.stdout[-3000:]
    for kind, r in zip(SPELLINGS, results):
        err = [line.split("\r")[-1] for line in r["err"].strip().splitlines()]
        assert r["code"] == 2 and len(err) == 1 and err[0].startswith("error: --out "), (kind, err)
        assert " is " in err[0] and "a job never writes over, inside or around what it reads" in err[0], err
    assert _tree_digest(victim) == before
    assert sorted(p.name for p in cwd.iterdir()) == []  # no lock, staging or output left beside it


def test_a_publish_over_a_directory_this_process_reads_is_refused_not_awaited(inputs, tmp_path):  # noqa: F811
    """The lock's own guard, below the path checks: the exclusive side asked for by a thread
    that holds the shared side is one error (an `flock` on a second descriptor of the same
    file would wait for ever)."""
    link = tmp_path / "alias"
    link.symlink_to(inputs["converted"])
    with reading(inputs["converted"]):
        with pytest.raises(CheckpointError, match="is being read by this job itself"):
            with readers_excluded(link):
                pass
    with readers_excluded(link):  # released: the exclusive side is free again
        pass

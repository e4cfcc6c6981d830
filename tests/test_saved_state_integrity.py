"""A saved model's damage is seen, and Orbax's failures are one line: flipped bytes in one
Orbax data file fail every job that reads the model (one line naming the layer, exit 2);
older manifests without checksums still load; a full disk inside an Orbax write (convert's
save, train's checkpoints) is one line naming the path, with the resume giving the same
model; a truncated data file is refused without "Event loop is closed" noise."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from orbax.checkpoint._src.serialization import serialization

from cmoe_jax import atomic_files
from cmoe_jax.atomic_files import write_json_atomic
from cmoe_jax.checkpoint import MANIFEST, restore_model
from cmoe_jax.checkpoint.seal import SEAL
from cmoe_jax.errors import CheckpointError, run_job
from cmoe_jax.loading import load_model
from cmoe_jax.orbax_io import os_error_of
from cmoe_jax.state_digests import DIGESTS
from cmoe_jax.train.run_checkpoints import RunCheckpoints
from tests.test_bad_input import _compress, _convert, _eval, _export, _train, inputs  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


def _largest_data_file(part: Path) -> Path:
    """The biggest file of an Orbax checkpoint's data (`.../d/*`): where its array bytes are."""
    return max((f for f in part.rglob("*") if f.is_file() and f.parent.name == "d"),
               key=lambda f: f.stat().st_size)


def _flip_two_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle] ^= 0xFF
    data[middle + 1] ^= 0x0F
    path.write_bytes(bytes(data))


def _leaves(directory: Path) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(restore_model(directory)))]


@pytest.fixture
def damaged(inputs, tmp_path):
    """A copy of the converted model with two bytes flipped in layer 1's array data."""
    bad = tmp_path / "damaged"
    shutil.copytree(inputs["converted"], bad)
    _flip_two_bytes(_largest_data_file(bad / "state" / "layer_0001"))
    return bad


@pytest.mark.parametrize("job", [_eval, _export, _compress, _train], ids=["eval", "export", "compress",
                                                                          "train"])
def test_flipped_bytes_fail_every_reader_naming_the_layer(inputs, damaged, tmp_path, capsys, job):
    capsys.readouterr()
    assert job(inputs, tmp_path / "out", model=damaged) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert str(damaged / "state" / "layer_0001") in err[0] and "restore it from a copy" in err[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_flipped_bytes_fail_load_model(damaged):
    with pytest.raises(CheckpointError, match="state/layer_0001: .* does not match the checksum"):
        load_model(str(damaged))


def test_a_manifest_without_checksums_loads_as_before(inputs, tmp_path):
    manifest = json.loads((inputs["converted"] / MANIFEST).read_text())
    parts = manifest[DIGESTS]["parts"]
    assert sorted(parts) == ["layer_0000", "layer_0001", "rest"]
    older = tmp_path / "older"
    shutil.copytree(inputs["converted"], older)
    _flip_two_bytes(_largest_data_file(older / "state" / "layer_0001"))
    del manifest[DIGESTS], manifest[SEAL]  # neither checksums nor a seal, as then
    write_json_atomic(older / MANIFEST, manifest)
    # no checksums, no check: the flipped bytes load (what every directory did before)
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(older), _leaves(inputs["converted"])))


TENSORSTORE_FULL = ValueError(  # copied from a save onto a full 2 MiB tmpfs
    'RESOURCE_EXHAUSTED: Error writing "a/0" in OCDBT database at local file "/x.orbax-checkpoint-tmp/'
    'ocdbt.process_0/": Failed writing: "/x.orbax-checkpoint-tmp/ocdbt.process_0/d/0135e6d6": Failed to '
    "write 5083136 bytes to file 11: No space left on device [os_error_code='28']")
# as Orbax's own metadata writes (etils write_text) fail on a full disk: no file named
METADATA_FULL = OSError(errno.ENOSPC, "No space left on device")


def _disk_full_inside_orbax(monkeypatch, error=TENSORSTORE_FULL):
    """Orbax's array writes fail, inside its writer threads, as a full disk fails them."""
    async def full(*args, **kwargs):
        raise error

    monkeypatch.setattr(serialization, "async_serialize_from_host", full)


def test_disk_full_in_converts_save_is_one_line_and_resume_is_identical(inputs, tmp_path, capsys,
                                                                         caplog, monkeypatch):
    out = tmp_path / "moe"
    _disk_full_inside_orbax(monkeypatch)
    capsys.readouterr()
    assert _convert(inputs, out, "--no-progress") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device at " in err[0], err
    assert f"{tmp_path / 'moe.partial'}/" in err[0] and "/state/rest: free some space" in err[0]
    assert not [r for r in caplog.records if r.exc_info], "Orbax's writer threads logged tracebacks"
    monkeypatch.undo()
    assert _convert(inputs, out, "--resume", "--no-progress") == 0
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(out), _leaves(inputs["converted"])))


@pytest.mark.parametrize("message, code", [
    ("RESOURCE_EXHAUSTED: ... No space left on device [os_error_code='28']", errno.ENOSPC),
    ("PERMISSION_DENIED: Failed writing: \"/x/d/1\": Permission denied [os_error_code='13']", errno.EACCES),
    ("RESOURCE_EXHAUSTED: Error writing \"a/0\" in OCDBT database", errno.ENOSPC),
    ("UNKNOWN: Failed writing: \"/x/d/1\"", errno.EIO),
    ("INVALID_ARGUMENT: shape mismatch", None),  # not the environment: a bug keeps its traceback
])
def test_orbax_write_errors_map_to_the_environments_oserror(message, code, tmp_path):
    refused = os_error_of(ValueError(message), tmp_path / "state")
    if code is None:
        assert refused is None
    else:
        assert (refused.errno, refused.filename) == (code, str(tmp_path / "state"))


def _train_tree() -> dict:
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.normal(size=(64, 64)), jnp.float32), "step": jnp.asarray(3),
            "opt": (jnp.asarray(rng.normal(size=(64, 64)), jnp.float32),)}


@pytest.mark.parametrize("error", [TENSORSTORE_FULL, METADATA_FULL], ids=["tensorstore", "metadata"])
def test_disk_full_in_a_train_checkpoint_is_one_line(tmp_path, capsys, caplog, monkeypatch, error):
    checkpoints = RunCheckpoints(tmp_path / "checkpoints")
    _disk_full_inside_orbax(monkeypatch, error)
    assert run_job(lambda _: checkpoints.save(1, _train_tree(), {}), None) == (None, 2)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"No space left on device at {tmp_path / 'checkpoints' / '1'}:" in err[0], err
    assert not [r for r in caplog.records if r.exc_info], "Orbax's writer threads logged tracebacks"


def test_a_resume_after_a_failed_checkpoint_save_is_quiet(tmp_path, caplog):
    """The unfinished temporary a failed save left (as on a full disk) is removed first, not
    reported by Orbax as a warning line beside the run's output."""
    unfinished = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp"
    unfinished.mkdir(parents=True)
    (unfinished / "half").write_bytes(b"x" * 100)
    checkpoints = RunCheckpoints(tmp_path / "checkpoints")
    checkpoints.save(2, _train_tree(), {})
    assert not [r.getMessage() for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]


def test_damaged_train_checkpoint_is_seen_on_resume(tmp_path):
    tree = _train_tree()
    checkpoints = RunCheckpoints(tmp_path / "checkpoints")
    checkpoints.save(1, tree, {"log": [1.5]})
    saved, meta = checkpoints.restore(1, tree)
    assert meta == {"log": [1.5]} and np.array_equal(saved["w"], tree["w"])
    _flip_two_bytes(_largest_data_file(tmp_path / "checkpoints" / "1" / "state"))
    with pytest.raises(CheckpointError, match=r"checkpoints/1/state: .* does not match the checksum.*"
                                              r"delete that step's directory"):
        checkpoints.restore(1, tree)


def test_a_full_disk_in_a_small_write_names_the_file(tmp_path, capsys, monkeypatch):
    class FullDisk:
        def __init__(self, fd, mode):
            os.close(fd)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")  # as write() raises it: no file

    monkeypatch.setattr(atomic_files.os, "fdopen", FullDisk)
    target = tmp_path / "report.json"
    assert run_job(lambda _: write_json_atomic(target, {"a": 1}), None) == (None, 2)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: No space left on device at {target}: free some space, then rerun (a job with "
                   "--resume continues from whatever work it had staged, if any)"]
    assert list(tmp_path.iterdir()) == []


def test_truncated_data_file_is_refused_without_event_loop_noise(inputs, tmp_path):
    """Several runs: the noise came in most runs, not all (threads racing the loop's close)."""
    bad = tmp_path / "truncated"
    shutil.copytree(inputs["converted"], bad)
    data = _largest_data_file(bad / "state" / "layer_0001")
    data.write_bytes(data.read_bytes()[:32])
    for _ in range(4):
        proc = subprocess.run([sys.executable, "-m", "cmoe_jax.export", "--model", str(bad), "--out",
                               str(tmp_path / "hf"), "--calib-samples", "0", "--no-progress"],
                              capture_output=True, text=True, cwd=ROOT, env=dict(os.environ))
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(err) == 1, proc.stderr[-3000:]
        assert str(bad / "state" / "layer_0001") in err[0] and "Event loop is closed" not in proc.stderr

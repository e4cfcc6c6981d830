"""A converted model's manifest is checked like its arrays: every single-value edit of it (each
value of every key, nested ones included, one at a time) is refused with one line that names
`cmoe_manifest.json`, or loads to the identical model; a manifest written before manifests
were sealed loads as it did."""
from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.bad_inputs import changed_value, json_leaves, set_at
from cmoe_jax.checkpoint import MANIFEST
from cmoe_jax.checkpoint.seal import SEAL
from cmoe_jax.errors import CheckpointError
from cmoe_jax.eval.cli import main as eval_main
from cmoe_jax.loading import load_model
from tests.test_bad_input import inputs  # noqa: F401 (fixture)


def _logits(directory):
    tokens = jnp.asarray(np.arange(2, 18, dtype=np.int32)[None])
    return np.asarray(load_model(str(directory), progress=False).model(tokens))


def test_every_single_edit_of_the_manifest_is_refused_naming_it(inputs, tmp_path):  # noqa: F811
    d = tmp_path / "conv"
    shutil.copytree(inputs["converted"], d)
    original = json.loads((d / MANIFEST).read_text())
    leaves = list(json_leaves(original))
    assert len(leaves) > 50 and (SEAL,) in [p for p, _ in leaves]
    assert ("model_config", "activation") in [p for p, _ in leaves]
    for path, value in leaves:
        manifest = json.loads(json.dumps(original))
        set_at(manifest, path, changed_value(value))
        (d / MANIFEST).write_text(json.dumps(manifest, indent=1))
        with pytest.raises(CheckpointError) as e:
            load_model(str(d), progress=False)
        line = str(e.value)
        assert "\n" not in line and f"{d / MANIFEST} was changed after it was written" in line, (path, line)


def test_an_edit_is_one_error_line_from_the_cli(inputs, tmp_path, capsys):  # noqa: F811
    """The reported cases: top_k and the activation changed the perplexity with exit 0; a
    checksum edit blamed the state, not the manifest."""
    d = tmp_path / "conv"
    shutil.copytree(inputs["converted"], d)
    original = (d / MANIFEST).read_text()
    for edit in (lambda m: m["model_config"]["moe_layers"][0].update(top_k=3),
                 lambda m: m["model_config"].update(activation="gelu"),
                 lambda m: m["state_digests"]["parts"]["rest"].update(
                     {k: "float32:0000000000000000" for k in m["state_digests"]["parts"]["rest"]})):
        manifest = json.loads(original)
        edit(manifest)
        (d / MANIFEST).write_text(json.dumps(manifest))
        code = eval_main(["--model", str(d), "--data-path", str(inputs["text"]), "--seqlen", "16",
                          "--max-windows", "1", "--no-progress"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {d / MANIFEST} was changed"), err


def test_a_manifest_written_before_seals_loads_as_before(inputs, tmp_path):  # noqa: F811
    d = tmp_path / "old"
    shutil.copytree(inputs["converted"], d)
    manifest = json.loads((d / MANIFEST).read_text())
    del manifest[SEAL]
    (d / MANIFEST).write_text(json.dumps(manifest))
    np.testing.assert_array_equal(_logits(d), _logits(inputs["converted"]))

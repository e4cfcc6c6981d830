"""Save and load converted models: an Orbax checkpoint of the NNX state plus a JSON manifest.

Layout of a converted model directory:
    cmoe_manifest.json   source model, plan, calibration, per-layer neuron indices, timings
    state/               Orbax StandardCheckpointer of `nnx.state(model)`
    tokenizer/           the source tokenizer (so `python -m cmoe_jax.eval` needs nothing else)
Everything is written into a staging directory first and renamed into place at the end, so
an interrupted run never leaves a half-written model at the output path.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from cmoe_jax.errors import CheckpointError
from cmoe_jax.models import Decoder, ModelConfig
from cmoe_jax.sharding import data_mesh, param_sharding

MANIFEST = "cmoe_manifest.json"
FORMAT = "cmoe_jax.converted/v1"


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def save_converted(model: Decoder, manifest: dict, directory: Path, tokenizer=None) -> None:
    """Write model state, tokenizer and manifest into `directory` (which must not exist yet)."""
    directory = Path(directory)
    directory.mkdir(parents=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((directory / "state").absolute(), nnx.state(model))
    checkpointer.wait_until_finished()
    if tokenizer is not None:
        tokenizer.hf.save_pretrained(str(directory / "tokenizer"))
    manifest = dict(manifest, format=FORMAT, model_config=model.config.to_dict())
    write_json_atomic(directory / MANIFEST, manifest)


def publish(staging: Path, out: Path, overwrite: bool) -> None:
    """Move a finished staging directory to `out` (replacing it only with overwrite)."""
    if out.exists():
        if not overwrite:
            raise CheckpointError(f"{out} exists: pass --overwrite to replace it")
        trash = out.with_name(out.name + ".old")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(out, trash)
        os.replace(staging, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, out)


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise CheckpointError(f"{directory} is not a converted cmoe_jax model ({MANIFEST} missing)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown format {manifest.get('format')!r}, expected {FORMAT}")
    return manifest


def load_converted(directory: Path, *, dtype=jnp.float32, mesh=None):
    """A converted model as a `LoadedModel`, restored directly onto its target shardings."""
    from cmoe_jax.loading.load import LoadedModel
    from cmoe_jax.loading.tokenizer import load_tokenizer

    directory = Path(directory)
    manifest = read_manifest(directory)
    cfg = ModelConfig.from_dict(manifest["model_config"])
    mesh = mesh if mesh is not None else data_mesh()
    abstract = nnx.eval_shape(lambda: Decoder(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    flat = nnx.to_flat_state(abstract_state)
    for path, var in flat:
        v = var.get_value()
        var.set_value(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=param_sharding(path, v.shape, mesh)))
    target = nnx.from_flat_state(flat)
    try:
        state = ocp.StandardCheckpointer().restore((directory / "state").absolute(), target)
    except Exception as e:
        raise CheckpointError(f"cannot restore {directory / 'state'} ({e}): the checkpoint is "
                              "corrupted or was written by another configuration") from e
    if jnp.dtype(dtype) != jnp.float32:
        # merge into a graph built for `dtype`, so every module (the MoE layers' compute dtype
        # included) runs in it, not only the parameters
        state = jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a,
                             state)
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, state)
    tok_dir = directory / "tokenizer"
    tokenizer = load_tokenizer(tok_dir) if tok_dir.exists() else None
    return LoadedModel(model, cfg, tokenizer, str(directory), directory)

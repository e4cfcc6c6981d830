"""The converted-model directory format, and the staging/publish protocol every job uses.

Layout of a converted (or fine-tuned) model directory:
    cmoe_manifest.json   source model, plan, calibration, per-layer neuron indices, timings
    state/               Orbax StandardCheckpointers: one per decoder layer (state/layer_0000,
                         ...) plus state/rest (embedding, final norm, LM head), manifest
                         "state_layout": "per_layer", written one layer at a time whatever
                         the in-memory storage (stacked layers are sliced one by one); older
                         directories hold one checkpoint of the whole state with its layers
                         per index, and still load
    tokenizer/           the source tokenizer (so `python -m cmoe_jax.eval` needs nothing else)
Jobs write into `staging_dir(out)` and publish it at the end (`cmoe_jax.jobs`), so an
interrupted run never leaves a half-written model at the output path. This module sits below both `loading`
(which reads these directories) and `convert` / `train` (which write them).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from cmoe_jax import distributed
from cmoe_jax.atomic_files import remove_write_leftovers, write_bytes_atomic, write_json_atomic  # noqa: F401
from cmoe_jax.errors import CheckpointError
from cmoe_jax.faults import fault_point
from cmoe_jax.models import Decoder, ModelConfig
from cmoe_jax.models.stack import layer_state
from cmoe_jax.sharding import make_mesh, place_state, placed_split, shardings_of
from cmoe_jax.state_digests import DIGESTS, check_digests, manifest_digests, path_name, save_checked

MANIFEST = "cmoe_manifest.json"
FORMAT = "cmoe_jax.converted/v1"


def staging_dir(out: Path) -> Path:
    """Where a job writing `out` works until it publishes: `out.partial`."""
    out = Path(out)
    return out.with_name(out.name + ".partial")


def is_converted(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / MANIFEST).exists()


def save_converted(model: Decoder, manifest: dict, directory: Path, tokenizer=None) -> None:
    """Write model state, tokenizer and manifest into `directory` (which must not exist yet).

    The state goes one decoder layer at a time (the per-layer layout), so saving a model
    whose layers are stacked holds one layer's slice beside it, not a copy of every layer."""
    directory = Path(directory)
    if distributed.is_main():
        (directory / "state").mkdir(parents=True)
    distributed.barrier("save_converted:mkdir")
    # every process calls Orbax (it needs all of them); each piece is written once
    checkpointer = ocp.StandardCheckpointer()

    def save(part: str, state: nnx.State) -> None:
        save_checked(checkpointer, (directory / "state" / part).absolute(),
                     distributed.replicated_global(state))

    save("rest", without_layers(nnx.state(model)))
    for i in range(model.config.num_layers):
        save(layer_part(i), layer_state(model, i))
    if distributed.is_main():
        write_manifest(directory, model.config, dict(manifest, state_layout=PER_LAYER), tokenizer)
    distributed.barrier("save_converted:manifest")


def write_manifest(directory: Path, config: ModelConfig, manifest: dict, tokenizer=None) -> None:
    """The tokenizer and the manifest: the last files of a converted directory, written once
    its state is complete."""
    if tokenizer is not None:
        tokenizer.hf.save_pretrained(str(Path(directory) / "tokenizer"))
    manifest = dict(manifest, **manifest_digests(Path(directory) / "state"), format=FORMAT,
                    model_config=config.to_dict())
    write_json_atomic(Path(directory) / MANIFEST, manifest)


PER_LAYER = "per_layer"  # manifest["state_layout"] of a directory written layer by layer
DAMAGED = "write it again with the job that made it, or restore it from a copy"


def layer_part(index: int) -> str:
    return f"layer_{index:04d}"


def save_state_part(directory: Path, part: str, state: nnx.State) -> None:
    """One piece of a per-layer state (`layer_part(i)` or "rest"), written now, so a
    streamed conversion holds one layer at a time; an existing piece is replaced (resume)."""
    path = (Path(directory) / "state" / part).absolute()
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_checked(ocp.StandardCheckpointer(), path, state)


def without_layers(state: nnx.State) -> nnx.State:
    """The "rest" part of a Decoder state: everything outside its decoder layers."""
    return nnx.State({k: v for k, v in state.items() if k != "layers"})


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise CheckpointError(f"{directory} is not a converted cmoe_jax model ({MANIFEST} missing)")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}): the model directory is damaged; "
                              "write it again with the job that made it") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        manifest = manifest if isinstance(manifest, dict) else {}
        raise CheckpointError(f"{path}: unknown format {manifest.get('format')!r}, expected {FORMAT}")
    if not isinstance(manifest.get("model_config"), dict):
        raise CheckpointError(f"{path} has no model_config: the model directory is damaged; "
                              "write it again with the job that made it")
    return manifest


READERS_LOCKED = (MANIFEST, "cmoe_export.json")  # the record whose flock is a directory's readers' lock


def _readers_lock_file(directory: Path) -> Path:
    """The file whose `flock` guards the directory's readers: a converted model's manifest or an
    exported Hugging Face directory's record."""
    for name in READERS_LOCKED:
        if (Path(directory) / name).exists() or (Path(directory) / name).is_symlink():
            return Path(directory) / name
    return Path(directory) / MANIFEST


def _open_manifest(directory: Path) -> int | None:
    path = _readers_lock_file(directory)
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{path} is a symbolic link: a model "
                                  "directory's files must be its own; write it again") from None
        raise


@contextmanager
def reading(directory: Path):
    """Hold the shared side of the directory's readers' lock (an `flock` on its manifest)
    while reading it: an overwrite waits for it (`readers_excluded`), so a reader sees the
    old model or the new one, never layers of both."""
    while True:
        fd = _open_manifest(directory)
        if fd is None:  # no manifest: read_manifest says so in one line
            yield
            return
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            same = os.fstat(fd).st_ino == os.stat(_readers_lock_file(directory)).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # replaced between the open and the lock: read the new one
    try:
        yield
    finally:
        os.close(fd)


@contextmanager
def readers_excluded(directory: Path):
    """The exclusive side of `reading`: held while a publish moves `directory` away."""
    fd = _open_manifest(directory) if Path(directory).is_dir() else None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)


def verify_layout(directory: Path, manifest: dict) -> None:
    """One line unless the state on disk is what the manifest describes: every path inside
    the directory (symbolic links resolved), one `layer_NNNN` per manifest layer, no more."""
    root = Path(directory).resolve()
    state = Path(directory) / "state"
    for base, dirs, files in os.walk(state):
        for name in dirs + files:
            p = Path(base) / name
            if p.is_symlink() and not p.resolve().is_relative_to(root):
                raise CheckpointError(f"{p} leads outside the model directory {directory}: a model "
                                      "directory must hold its own state; write it again")
    if not state.resolve().is_relative_to(root):
        raise CheckpointError(f"{state} leads outside the model directory: write it again")
    if manifest.get("state_layout") != PER_LAYER:
        return
    n = manifest["model_config"].get("num_layers")
    found = sorted(p.name for p in state.glob("layer_*")) if state.is_dir() else []
    if found != [layer_part(i) for i in range(n or 0)]:
        raise CheckpointError(f"{directory}: the manifest describes {n} layers but state/ holds "
                              f"{len(found)} layer states ({found[0] if found else 'none'} .. "
                              f"{found[-1] if found else ''}): the directory is damaged or was "
                              "edited; write it again with the job that made it")


def _check_like(restored, target, where: Path):
    """The restored arrays have the shapes and dtypes the manifest's config implies."""
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(target)):
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            raise CheckpointError(f"{where}: {path_name(path)} is {got.dtype}{list(got.shape)} but the "
                                  f"manifest's config implies {want.dtype}{list(want.shape)}: the directory "
                                  "is damaged or mixed; write it again with the job that made it")
    return restored


def restore_model(directory: Path, *, dtype=jnp.float32, mesh=None) -> Decoder:
    """The model saved in a converted directory, restored directly onto its shardings, read
    under the directory's readers' lock and checked against its manifest."""
    directory = Path(directory)
    with reading(directory):
        manifest = read_manifest(directory)
        verify_layout(directory, manifest)
        cfg, state, graphdef, mesh = _restore_state(directory, manifest, mesh)
    if jnp.dtype(dtype) != jnp.float32:
        # merge into a graph built for `dtype`, so every module (the MoE layers' compute dtype
        # included) runs in it, not only the parameters
        state = jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a,
                             state)
        graphdef, _ = nnx.split(nnx.eval_shape(
            lambda: Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0), stack=False)))
    return stacked_on(nnx.merge(graphdef, state), mesh)


def _restore_state(directory: Path, manifest: dict, mesh):
    cfg = ModelConfig.from_dict(manifest["model_config"])
    mesh = mesh if mesh is not None else make_mesh(devices=jax.local_devices())
    abstract = nnx.eval_shape(lambda: Decoder(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0), stack=False))
    graphdef, abstract_state = nnx.split(abstract)
    target = place_state(abstract_state, shardings_of(abstract, mesh))
    checkpointer = ocp.StandardCheckpointer()
    recorded = manifest.get(DIGESTS, {}).get("parts", {})
    reading_now = [directory / "state"]  # the piece an Orbax error is about

    def read(part: str, like):
        path = reading_now[0] = (directory / "state" / part).absolute()
        restored = _check_like(checkpointer.restore(path, like), like, path)
        if part in recorded:
            check_digests(restored, recorded[part], path, DAMAGED)
        return restored

    try:
        if manifest.get("state_layout") == PER_LAYER:
            rest = read("rest", without_layers(target))
            state = target
            for key in rest:
                state[key] = rest[key]
            for i in range(cfg.num_layers):
                fault_point("read:layer")
                state["layers"][i] = read(layer_part(i), target["layers"][i])
        else:
            state = _check_like(checkpointer.restore((directory / "state").absolute(), target), target,
                                directory / "state")
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot restore {reading_now[0]} ({_first_line(e)}): the checkpoint "
                              "is corrupted or incomplete, or was written by another configuration; "
                              "write it again with the job that made it") from None
    finally:
        checkpointer.close()
    return cfg, state, graphdef, mesh


def _first_line(error: Exception, limit: int = 160) -> str:
    """The start of an exception's message: Orbax's can run to kilobytes over many lines."""
    text = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {text[0] if text else ''}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def stacked_on(model: Decoder, mesh) -> Decoder:
    """`model` with its layers stacked where they can be, every variable on its sharding."""
    stacked = model.stacked()
    return model if stacked is model else nnx.merge(*placed_split(stacked, mesh))

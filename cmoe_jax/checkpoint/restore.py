"""Reading a converted-model directory back: its state restored directly onto its shardings,
under the directory's readers' lock, every piece checked against the manifest."""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from cmoe_jax.checkpoint.layout import DAMAGED, PER_LAYER, layer_part, read_manifest, verify_layout, without_layers
from cmoe_jax.checkpoint.readers import reading
from cmoe_jax.errors import CheckpointError
from cmoe_jax.faults import fault_point
from cmoe_jax.host_arrays import aligned_copy, aligned_empty, copy_into
from cmoe_jax.models import Decoder, ModelConfig
from cmoe_jax.models.layer_parts import per_layer_paths
from cmoe_jax.sharding import make_mesh, place_state, placed_split, shardings_of
from cmoe_jax.state_digests import DIGESTS, check_digests, path_name


def _check_like(restored, target, where: Path):
    """The restored arrays have the shapes and dtypes the manifest's config implies."""
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(target)):
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            raise CheckpointError(f"{where}: {path_name(path)} is {got.dtype}{list(got.shape)} but the "
                                  f"manifest's config implies {want.dtype}{list(want.shape)}: the directory "
                                  "is damaged or mixed; write it again with the job that made it")
    return restored


def restore_model(directory: Path, *, dtype=jnp.float32, mesh=None, stack: bool = True) -> Decoder:
    """The model saved in a converted directory, restored directly onto its shardings, read
    under the directory's readers' lock and checked against its manifest; `stack=False`
    keeps one module per layer (each layer's weights a buffer of their own).

    A float32 restore of a per-layer directory into stacked layers fills each stack layer
    by layer (`_fill_stacked`), so the model is held once, not once per layer and again
    stacked."""
    directory = Path(directory)
    with reading(directory):
        manifest = read_manifest(directory)
        verify_layout(directory, manifest)
        cfg = ModelConfig.from_dict(manifest["model_config"], where=directory / "cmoe_manifest.json")
        into_stack = (stack and jnp.dtype(dtype) == jnp.float32 and manifest.get("state_layout") == PER_LAYER
                      and not any(s is not None and s.prototype_owner >= 0 for s in cfg.moe_layers))
        state, graphdef, mesh = _restore_state(directory, manifest, cfg, mesh, into_stack=into_stack)
    if into_stack:
        return nnx.merge(graphdef, state)
    if jnp.dtype(dtype) != jnp.float32:
        # merge into a graph built for `dtype`, so every module (the MoE layers' compute dtype
        # included) runs in it, not only the parameters
        state = jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a,
                             state)
        graphdef, _ = nnx.split(nnx.eval_shape(
            lambda: Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0), stack=False)))
    model = nnx.merge(graphdef, state)
    return stacked_on(model, mesh) if stack else model


def _restore_state(directory: Path, manifest: dict, cfg: ModelConfig, mesh, into_stack: bool = False):
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
            if into_stack:
                def read_layer(i):
                    fault_point("read:layer")
                    return read(layer_part(i), target["layers"][i])
                graphdef, state = _fill_stacked(cfg, mesh, rest, read_layer)
                return state, graphdef, mesh
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
    return state, graphdef, mesh


def _fill_stacked(cfg: ModelConfig, mesh, rest: nnx.State, read_layer):
    """(graphdef, state) of the model with its layers stacked where they can be: each stacked
    variable is one 64-byte-aligned host buffer filled row by row as `read_layer(i)` gives
    layer i, whose arrays are dropped once copied; the device then adopts the buffers (on a
    CPU without a copy). Peak memory: the model plus one layer."""
    abstract = nnx.eval_shape(lambda: Decoder(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shapes = {tuple(path): var.get_value().shape for path, var in nnx.to_flat_state(state)}
    rows = {}  # layer -> [(its variable's path inside the layer, the state path, row or None)]
    for path in shapes:
        if path[0] == "layers":
            held, stacked = per_layer_paths(abstract.layers, path)
            for row, layer_path in enumerate(held):
                rows.setdefault(layer_path[1], []).append((layer_path[2:], path, row if stacked else None))
    values = {tuple(path): var.get_value() for path, var in nnx.to_flat_state(rest)}
    for i in range(cfg.num_layers):
        layer = {tuple(path): var.get_value() for path, var in nnx.to_flat_state(read_layer(i))}
        for inside, path, row in rows.get(i, ()):
            arr = np.asarray(layer.pop(inside))
            if row is None:
                values[path] = aligned_copy(arr, arr.dtype)
                continue
            if path not in values:
                values[path] = aligned_empty(shapes[path], arr.dtype)
            copy_into(values[path][row], arr)
        del layer
    return graphdef, place_state(state, shardings_of(abstract, mesh), lambda path, _: values.pop(tuple(path)))


def _first_line(error: Exception, limit: int = 160) -> str:
    """The start of an exception's message: Orbax's can run to kilobytes over many lines."""
    text = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {text[0] if text else ''}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def stacked_on(model: Decoder, mesh) -> Decoder:
    """`model` with its layers stacked where they can be, every variable on its sharding."""
    stacked = model.stacked()
    return model if stacked is model else nnx.merge(*placed_split(stacked, mesh))

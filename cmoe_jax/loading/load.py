"""Load a checkpoint into a `Decoder`, one tensor at a time, straight onto its sharding.

The model is built abstractly (`nnx.eval_shape`), then each parameter is read, checked
against the config's shape, cast into a 64-byte-aligned host buffer (stacked layers: one
buffer, filled layer by layer) and `device_put` with its target sharding. On a CPU the
device adopts such a buffer without copying it, so the model is held once and peak host
memory stays near the model plus one tensor (the largest tensors come first, while little
else is held); the checkpoint's pages read for a stacked parameter are dropped after it
(`TensorSource.release`).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from cmoe_jax.checkpoint import MANIFEST, is_converted, read_manifest, restore_model
from cmoe_jax.errors import CheckpointError
from cmoe_jax.loading import hf_names
from cmoe_jax.host_arrays import aligned_copy, aligned_empty, copy_into
from cmoe_jax.loading.sources import GGUFSource, TensorSource, open_source
from cmoe_jax.loading.tokenizer import Tokenizer, load_tokenizer
from cmoe_jax.loading.zoo import resolve
from cmoe_jax.models import Decoder, DecoderLayer, ModelConfig
from cmoe_jax.models.config_fields import check_gguf
from cmoe_jax.models.layer_parts import per_layer_paths
from cmoe_jax.sharding import make_mesh, place_state, shardings_of


@dataclasses.dataclass
class LoadedModel:
    model: Decoder
    config: ModelConfig
    tokenizer: Tokenizer | None
    name: str
    path: Path


def open_model(name_or_path: str) -> tuple[ModelConfig, Path, TensorSource | None]:
    """(config, local path, the parsed GGUF source or None): what `load_model` needs besides
    the weights, read once (a GGUF file is parsed here and reused)."""
    path = resolve(name_or_path)
    if is_converted(path):
        return ModelConfig.from_dict(read_manifest(path)["model_config"], where=path / MANIFEST), path, None
    if path.is_file() and path.suffix == ".gguf":
        source = GGUFSource(path)
        check_gguf(source.field, source.arch, path)  # before its metadata is turned into a config
        return ModelConfig.from_hf(source.hf_config(), where=path), path, source
    return _hf_config(path), path, None


def load_config(name_or_path: str) -> tuple[ModelConfig, Path]:
    """Config only (no weights): lets callers validate arguments before any heavy work."""
    cfg, path, _ = open_model(name_or_path)
    return cfg, path


def _hf_config(path: Path) -> ModelConfig:
    if path.is_file():
        raise CheckpointError(f"{path} is a file but not a .gguf: give the checkpoint directory")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{cfg_file} is missing: a Hugging Face checkpoint directory needs "
                              "config.json next to its weights")
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file} is not a file: a Hugging Face checkpoint directory needs "
                              "its config.json file next to its weights")
    try:
        raw = json.loads(cfg_file.read_text())
    except ValueError as e:  # not JSON, or not UTF-8 text
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e})") from None
    return ModelConfig.from_hf(raw, where=cfg_file)


def read_parameter(source: TensorSource, cfg: ModelConfig, path: tuple, expected: tuple) -> np.ndarray:
    """One Decoder parameter (state `path`) from the source in JAX layout, shape-checked
    (possibly a transposed view of the checkpoint's array; `host_arrays.copy_into` places it)."""
    carved = _carved_name(cfg, path)
    if carved in source:  # a carved export's MoE layer: cmoe_jax's own name and layout
        name, arr = carved, source.get(carved)
    elif path[-1] in hf_names.EXPERT_LEAVES and path[2] == "mlp":
        name = f"model.layers.{path[1]}.mlp.experts.*.{path[3]}"
        arr = hf_names.fetch_experts(source, cfg, path[1], path[3], expected[0])
    else:
        name, arr = hf_names.fetch(source, path, cfg)
    if arr.dtype.kind in "biu" and path[-1] != INDEX_TABLE:
        raise CheckpointError(f"tensor {name!r} holds {arr.dtype} values where the model has weights: "
                              "the file is damaged or not this model's; re-download the model")
    if tuple(arr.shape) != tuple(expected):
        held, implied = _as_in_file(source, name, arr.shape, expected)
        raise CheckpointError(f"tensor {name!r} has shape {held} in the file but the config "
                              f"implies {implied}: config.json does not match the weights")
    return np.asarray(arr)


INDEX_TABLE = "slot_map"  # ConMoE's slot -> prototype map: whole numbers, read as they are


def _held_dtype(path: tuple, arr: np.ndarray, dtype):
    """The model's dtype for weights; an index table keeps its own."""
    return arr.dtype if path[-1] == INDEX_TABLE else jnp.dtype(dtype)


def _carved_name(cfg: ModelConfig, path: tuple) -> str | None:
    """Where `export` writes an MoE layer's parameter of a carved model (`cmoe_jax.models.carved_export`)."""
    if len(path) == 4 and path[0] == "layers" and path[2] == "mlp" and cfg.ffn_spec(path[1]) is not None:
        return f"model.layers.{path[1]}.mlp.{path[3]}"
    return None


def _as_in_file(source: TensorSource, name: str, got: tuple, expected: tuple) -> tuple[tuple, tuple]:
    """(shape held, shape the config implies), both in the file's layout: projections are
    stored [out, in] ([in, out] here), expert stacks one [out, in] tensor per expert."""
    got, expected = tuple(got), tuple(expected)
    if "*" in name:  # per-expert tensors: the shape of one expert as stored
        return got[1:][::-1], expected[1:][::-1]
    stored = tuple(source.get(name).shape)
    if stored == got:
        return got, expected
    return stored, expected[::-1]


def _fill(source: TensorSource, cfg: ModelConfig, abstract: nnx.Module, prefix: tuple, *, dtype,
          mesh, desc: str | None = None):
    """`abstract` (a Decoder or one of its layers, at state path `prefix`) with every
    parameter read from the source and placed on its sharding, one tensor at a time."""
    graphdef, state = nnx.split(abstract)
    shardings = shardings_of(abstract, mesh)
    bar = tqdm(total=len(shardings), desc=desc, disable=desc is None, leave=False)

    def read(path, abstract_value):
        bar.update(1)
        path, shape = prefix + tuple(path), abstract_value.shape
        layers, stacked = per_layer_paths(getattr(abstract, "layers", None), path)
        if stacked:  # stacked layers: every layer's tensor, stacked
            out = None
            for i, p in enumerate(layers):
                arr = read_parameter(source, cfg, p, shape[1:])
                if out is None:
                    out = aligned_empty(shape, _held_dtype(p, arr, dtype))
                copy_into(out[i], arr)
            source.release()
            return out
        arr = read_parameter(source, cfg, layers[0], shape)
        return aligned_copy(arr, _held_dtype(layers[0], arr, dtype))

    try:
        state = place_state(state, shardings, read, largest_first=True)
    finally:
        bar.close()  # also on an error: the bar's line is cleared before the error is printed
    return nnx.merge(graphdef, state)


def _default_mesh(mesh):
    return mesh if mesh is not None else make_mesh(devices=jax.local_devices())


def load_weights(source: TensorSource, cfg: ModelConfig, *, dtype=jnp.float32, mesh=None,
                 progress: bool = True, stack: bool = True) -> Decoder:
    """Fill an abstract Decoder from a tensor source, placing each tensor on its sharding."""
    abstract = nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0), stack=stack))
    return _fill(source, cfg, abstract, (), dtype=dtype, mesh=_default_mesh(mesh),
                 desc="loading weights" if progress else None)


def load_outer(source: TensorSource, cfg: ModelConfig, *, dtype=jnp.float32, mesh=None) -> Decoder:
    """The model without its decoder layers (embedding, final norm, LM head): what a
    streamed job holds besides the one layer it works on."""
    return load_weights(source, dataclasses.replace(cfg, num_layers=0, moe_layers=()),
                        dtype=dtype, mesh=mesh, progress=False)


def load_layer(source: TensorSource, cfg: ModelConfig, index: int, *, dtype=jnp.float32,
               mesh=None) -> DecoderLayer:
    """Decoder layer `index` alone, read from the source now."""
    abstract = nnx.eval_shape(lambda: DecoderLayer(cfg, index, dtype=dtype, rngs=nnx.Rngs(0)))
    return _fill(source, cfg, abstract, ("layers", index), dtype=dtype, mesh=_default_mesh(mesh))


def load_converted(directory: Path, *, dtype=jnp.float32, mesh=None) -> LoadedModel:
    """A converted model directory as a `LoadedModel`, restored directly onto its shardings."""
    directory = Path(directory)
    model = restore_model(directory, dtype=dtype, mesh=mesh)
    return LoadedModel(model, model.config, load_tokenizer(directory), str(directory), directory)


_UNSET = object()


def load_model(name_or_path: str = "smollm2", *, dtype=jnp.float32, mesh=None,
               progress: bool = True, tokenizer=_UNSET, opened=None, stack: bool = True) -> LoadedModel:
    """Load a Hugging Face directory / Hub id / GGUF file / converted cmoe_jax model.

    `tokenizer` (when given) and `opened` (what `open_model` returned) spare a job that has
    them already a second read of the tokenizer and a second parse of a GGUF file.
    `stack=False` keeps a checkpoint's layers one module each (a layer-by-layer conversion
    then reads each layer where it lies instead of slicing it out of a stack, and a
    decoding step reads each layer's weights in place: `cmoe_jax.generate`)."""
    cfg, path, source = opened if opened is not None else open_model(name_or_path)
    if is_converted(path):
        model = restore_model(path, dtype=dtype, mesh=mesh, stack=stack)
        if tokenizer is _UNSET:
            tokenizer = load_tokenizer(path)
        return LoadedModel(model, model.config, tokenizer, str(path), path)
    source = source if source is not None else open_source(path)
    model = load_weights(source, cfg, dtype=dtype, mesh=mesh, progress=progress, stack=stack)
    if tokenizer is _UNSET and isinstance(source, GGUFSource):  # reuse the parsed file
        tokenizer = load_tokenizer(source.path, gguf_reader=source.reader)
    elif tokenizer is _UNSET:
        tokenizer = load_tokenizer(path)
    return LoadedModel(model, cfg, tokenizer, str(name_or_path), path)

"""Load a checkpoint into a `Decoder`, one tensor at a time, straight onto its sharding.

The model is built abstractly (`nnx.eval_shape`), then each parameter is read, checked
against the config's shape, cast and `device_put` with its target sharding, so peak host
memory stays near one tensor (one per layer for stacked layers) plus the model on device.
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

from cmoe_jax.checkpoint import MANIFEST, is_converted, restore_model
from cmoe_jax.errors import CheckpointError
from cmoe_jax.loading import hf_names
from cmoe_jax.loading.sources import GGUFSource, TensorSource, open_source
from cmoe_jax.loading.tokenizer import Tokenizer, load_tokenizer
from cmoe_jax.loading.zoo import resolve
from cmoe_jax.models import Decoder, DecoderLayer, ModelConfig
from cmoe_jax.models.stack import STACKED
from cmoe_jax.sharding import make_mesh, place_state, shardings_of


@dataclasses.dataclass
class LoadedModel:
    model: Decoder
    config: ModelConfig
    tokenizer: Tokenizer | None
    name: str
    path: Path


def load_config(name_or_path: str) -> tuple[ModelConfig, Path]:
    """Config only (no weights): lets callers validate arguments before any heavy work."""
    path = resolve(name_or_path)
    if is_converted(path):
        manifest = json.loads((path / MANIFEST).read_text())
        return ModelConfig.from_dict(manifest["model_config"]), path
    if path.is_file() and path.suffix == ".gguf":
        return ModelConfig.from_hf(GGUFSource(path).hf_config()), path
    if path.is_file():
        raise CheckpointError(f"{path} is a file but not a .gguf: give the checkpoint directory")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{cfg_file} is missing: a Hugging Face checkpoint directory needs "
                              "config.json next to its weights")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e})") from e
    return ModelConfig.from_hf(raw), path


def _to_dtype(a: np.ndarray, dtype) -> np.ndarray:
    return np.asarray(a).astype(jnp.dtype(dtype), copy=False)


def read_parameter(source: TensorSource, cfg: ModelConfig, path: tuple, expected: tuple,
                   dtype) -> np.ndarray:
    """One Decoder parameter (state `path`) from the source, shape-checked and cast."""
    if path[-1] in hf_names._EXPERT_NAMES and path[2] == "mlp":
        name = f"model.layers.{path[1]}.mlp.experts.*.{path[3]}"
        arr = hf_names.fetch_experts(source, path, expected[0])
    else:
        name, arr = hf_names.fetch(source, path, cfg.tie_word_embeddings)
    if tuple(arr.shape) != tuple(expected):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(arr.shape)} but the config "
                              f"implies {tuple(expected)}: config.json does not match the weights")
    return _to_dtype(arr, dtype)


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
        if path[:2] == ("layers", STACKED):  # stacked layers: every layer's tensor, stacked
            return np.stack([read_parameter(source, cfg, ("layers", i, *path[2:]), shape[1:], dtype)
                             for i in range(shape[0])])
        return read_parameter(source, cfg, path, shape, dtype)

    state = place_state(state, shardings, read)
    bar.close()
    return nnx.merge(graphdef, state)


def _default_mesh(mesh):
    return mesh if mesh is not None else make_mesh(devices=jax.local_devices())


def load_weights(source: TensorSource, cfg: ModelConfig, *, dtype=jnp.float32, mesh=None,
                 progress: bool = True) -> Decoder:
    """Fill an abstract Decoder from a tensor source, placing each tensor on its sharding."""
    abstract = nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
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
    tokenizer = load_tokenizer(directory)
    return LoadedModel(model, model.config, tokenizer, str(directory), directory)


def load_model(name_or_path: str = "smollm2", *, dtype=jnp.float32, mesh=None,
               progress: bool = True) -> LoadedModel:
    """Load a Hugging Face directory / Hub id / GGUF file / converted cmoe_jax model."""
    cfg, path = load_config(name_or_path)
    if is_converted(path):
        return load_converted(path, dtype=dtype, mesh=mesh)
    source = open_source(path)
    model = load_weights(source, cfg, dtype=dtype, mesh=mesh, progress=progress)
    if isinstance(source, GGUFSource):  # reuse the parsed file: reading it again costs seconds
        tokenizer = load_tokenizer(source.path, gguf_reader=source.reader)
    else:
        tokenizer = load_tokenizer(path)
    return LoadedModel(model, cfg, tokenizer, str(name_or_path), path)

"""Writing a converted-model directory: its state one decoder layer at a time, then the
tokenizer and the manifest, the last files, once the state is complete."""
from __future__ import annotations

import shutil
from pathlib import Path

import orbax.checkpoint as ocp
from flax import nnx

from cmoe_jax import distributed
from cmoe_jax.checkpoint.layout import FORMAT, MANIFEST, PER_LAYER, layer_part, without_layers
from cmoe_jax.checkpoint.seal import write_sealed
from cmoe_jax.models import Decoder, ModelConfig
from cmoe_jax.models.stack import layer_state
from cmoe_jax.state_digests import manifest_digests, save_checked


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
    write_sealed(Path(directory) / MANIFEST, manifest)


def save_state_part(directory: Path, part: str, state: nnx.State) -> None:
    """One piece of a per-layer state (`layer_part(i)` or "rest"), written now, so a
    streamed conversion holds one layer at a time; an existing piece is replaced (resume)."""
    path = (Path(directory) / "state" / part).absolute()
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_checked(ocp.StandardCheckpointer(), path, state)

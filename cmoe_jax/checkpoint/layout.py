"""The converted-model directory's names and layout: its manifest, read and checked, and the
state pieces a manifest describes (one `layer_NNNN` per decoder layer, plus "rest")."""
from __future__ import annotations

import json
import os
from pathlib import Path

from flax import nnx

from cmoe_jax.checkpoint.seal import check_seal
from cmoe_jax.errors import CheckpointError

MANIFEST = "cmoe_manifest.json"
FORMAT = "cmoe_jax.converted/v1"
PER_LAYER = "per_layer"  # manifest["state_layout"] of a directory written layer by layer
DAMAGED = "write it again with the job that made it, or restore it from a copy"


def is_converted(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / MANIFEST).exists()


def layer_part(index: int) -> str:
    return f"layer_{index:04d}"


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
    if isinstance(manifest, dict):
        check_seal(manifest, path, DAMAGED)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        manifest = manifest if isinstance(manifest, dict) else {}
        raise CheckpointError(f"{path}: unknown format {manifest.get('format')!r}, expected {FORMAT}")
    if not isinstance(manifest.get("model_config"), dict):
        raise CheckpointError(f"{path} has no model_config: the model directory is damaged; "
                              "write it again with the job that made it")
    return manifest


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

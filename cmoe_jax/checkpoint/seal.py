"""A manifest's own checksum: the arrays are checksummed (`cmoe_jax.state_digests`), and so is
the file that says how to read them.

The manifest holds everything a load reads (model config, plan, family, routing settings,
the arrays' checksums); a one-byte edit of it (`"top_k": 1` -> `3`) would otherwise load as a
different model and give wrong numbers without an error. The seal is a sha256 over the
manifest's JSON with sorted keys (so formatting does not matter, only content), written with
it and checked on every read. A manifest without a seal was written before manifests were
sealed and reads as before.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from cmoe_jax.atomic_files import write_json_atomic
from cmoe_jax.errors import CheckpointError

SEAL = "manifest_sha256"


def _digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != SEAL}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed(manifest: dict) -> dict:
    """`manifest` with its seal (any previous one replaced)."""
    return dict({k: v for k, v in manifest.items() if k != SEAL}, **{SEAL: _digest(manifest)})


def check_seal(manifest: dict, path: Path, remedy: str) -> None:
    """One line naming `path` unless the manifest is what was written (an unsealed one passes)."""
    if SEAL in manifest and manifest[SEAL] != _digest(manifest):
        raise CheckpointError(f"{path} was changed after it was written (its content does not match its "
                              f"{SEAL}): the manifest is damaged or edited; {remedy}")


def write_sealed(path: Path, manifest: dict) -> None:
    """Write a manifest with its seal."""
    write_json_atomic(Path(path), sealed(manifest))

"""Checksums of saved arrays: recorded when a state is written, checked when it is read back.

Orbax checksums only the index of each zarr shard (its `crc32c` index codec), not the array
data, so flipped bytes in a data file load as slightly different weights. Every array's
bytes are hashed from the host copy at save time (xxh3-64: ~30 GB/s, so loading stays within
a few percent of its time without it) and compared with the restored array's bytes.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import xxhash

from cmoe_jax import distributed
from cmoe_jax.atomic_files import write_json_atomic
from cmoe_jax.errors import CheckpointError
from cmoe_jax.orbax_io import orbax_writes

ALGORITHM = "xxh3_64"
DIGESTS = "state_digests"  # manifest: {"algorithm", "parts": {part: {array: digest}}}; older ones lack it
PART_DIGESTS = "cmoe_digests.json"  # a part's checksums beside its Orbax files, until the manifest


def path_name(path) -> str:
    """A tree path as `attn/q_proj` (attribute steps such as nnx's `.value` left out)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path
                    if not isinstance(k, jax.tree_util.GetAttrKey))


def _digest(array: np.ndarray) -> str:
    """`DTYPE:HEX`: a restore may cast (Orbax restores to the target's dtype), the check
    casts back to the saved dtype before hashing, exact for a widening cast."""
    flat = np.ascontiguousarray(array).reshape(-1)
    return f"{flat.dtype.name}:{xxhash.xxh3_64_intdigest(flat.view(np.uint8)):016x}"


def _named_host_arrays(tree) -> dict[str, np.ndarray]:
    host = distributed.to_host(tree)  # global arrays split over processes are gathered
    return {path_name(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(host)}


def array_digests(tree) -> dict[str, str]:
    """`{array name: digest}` of every array in `tree` (every process calls this where it
    calls Orbax)."""
    return {name: _digest(a) for name, a in _named_host_arrays(tree).items()}


def check_digests(tree, recorded: dict[str, str], where: Path, remedy: str) -> None:
    """One line naming `where` and its first array whose bytes differ from `recorded`."""
    arrays = _named_host_arrays(tree)
    for name in sorted(set(arrays) | set(recorded)):
        want = recorded.get(name)
        saved_dtype = want.split(":")[0] if isinstance(want, str) else None
        got = arrays.get(name)
        if got is not None and saved_dtype and got.dtype.name != saved_dtype:
            got = got.astype(jnp.dtype(saved_dtype))
        if got is None or _digest(got) != want:
            raise CheckpointError(f"{where}: {name} does not match the checksum recorded when it was "
                                  f"saved: the saved state is damaged; {remedy}")


def save_checked(checkpointer, path: Path, state) -> None:
    """An Orbax save of `state` at `path` (every process calls it), its arrays' checksums
    written beside it (`PART_DIGESTS`) once it is complete."""
    digests = array_digests(state)
    with orbax_writes(path):
        checkpointer.save(path, state)
        checkpointer.wait_until_finished()
    if distributed.is_main():
        write_json_atomic(Path(path) / PART_DIGESTS, digests)


def manifest_digests(state_dir: Path) -> dict:
    """`{DIGESTS: ...}` for a manifest, from the checksums its pieces' saves left under
    `state_dir` (a streamed conversion saves them over several runs); {} when none."""
    saved = sorted(Path(state_dir).glob(f"*/{PART_DIGESTS}"))
    parts = {f.parent.name: json.loads(f.read_text()) for f in saved}
    return {DIGESTS: {"algorithm": ALGORITHM, "parts": parts}} if parts else {}

"""The mesh as an MoE layer sees it: whether its experts run split over an expert axis, how
many devices the tokens split over, and a function run on each device's tokens.

Expert parallelism engages only under a mesh set with `jax.set_mesh` that has the layer's
expert axis (size > 1). A mesh entered the old way (`with mesh:`) is not seen by
`jax.get_abstract_mesh`, so a layer under it would silently run every expert on every
device: that case warns (`ExpertParallelWarning`).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec as P

DEFAULT_EXPERT_AXIS = "expert"


class ExpertParallelWarning(UserWarning):
    """A mesh with an expert axis is around, but the layer does not run expert-parallel."""


def expert_axis_size(axis: str | None, mesh=None) -> int:
    """Devices along `axis` of `mesh` (default: the mesh set by `jax.set_mesh`), 1 if absent."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if axis is None or axis not in mesh.axis_names:
        return 1
    return dict(mesh.shape)[axis]


def _legacy_mesh_size(axis: str) -> int:
    """Size of `axis` in a mesh entered with `with mesh:` (1 if none or on a JAX without it)."""
    try:
        from jax._src.mesh import thread_resources
        mesh = thread_resources.env.physical_mesh
    except (ImportError, AttributeError):  # pragma: no cover - other JAX versions
        return 1
    return dict(mesh.shape).get(axis, 1) if not mesh.empty else 1


def _sharded_size(axis: str, weight) -> int:
    """Devices a concrete weight array is split over along mesh axis `axis` (1: none)."""
    try:  # a tracer (inside jit) has no concrete sharding
        mesh = weight.sharding.mesh if isinstance(weight, jax.Array) else None
    except Exception:
        mesh = None
    if mesh is None or axis not in getattr(mesh, "axis_names", ()):
        return 1
    return dict(mesh.shape)[axis]


def expert_parallel_active(axis: str | None, weight=None) -> bool:
    """Whether the layer runs expert-parallel; warns (`ExpertParallelWarning`) when a mesh
    with `axis` is entered with `with mesh:` or holds the expert weights, but not set with
    `jax.set_mesh`, which is the only way expert parallelism engages."""
    if axis is None:
        return False
    if expert_axis_size(axis) > 1:
        return True
    n = max(_legacy_mesh_size(axis), _sharded_size(axis, weight))
    if n > 1:
        warnings.warn(f"a mesh with expert axis {axis!r} ({n} devices) is present but not set "
                      "with `jax.set_mesh(mesh)`: the MoE layer runs every expert on every "
                      "device (no expert parallelism); use `with jax.set_mesh(mesh):`, or "
                      "build the layer with expert_axis=None to silence this",
                      ExpertParallelWarning, stacklevel=3)
    return False


def token_devices(mesh=None) -> int:
    """Devices the tokens split over expert-parallel: every axis of the mesh set with
    `jax.set_mesh`."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    return max(1, mesh.size)


def token_split(mesh, num_tokens: int) -> P:
    """The PartitionSpec of tokens split over every axis of `mesh`."""
    if num_tokens % mesh.size:
        raise ValueError(f"{num_tokens} tokens do not split over {mesh.size} devices; "
                         f"pad the batch to a multiple of {mesh.size}")
    return P(tuple(mesh.axis_names))


def tokens_sharded(fn: Callable, x: jax.Array, params: Any, mesh=None):
    """`fn(x, params)` on each device's tokens (`x`, arrays `[T, ...]` or a pytree of them,
    split over every mesh axis; `params` replicated); the outputs keep the token split."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    tok = token_split(mesh, jax.tree.leaves(x)[0].shape[0])
    return jax.shard_map(fn, mesh=mesh, in_specs=(tok, P()), out_specs=tok)(x, params)

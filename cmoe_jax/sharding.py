"""Device meshes and parameter shardings, with the sharding rules kept as data.

Every variable carries the logical axes of its dimensions as Flax partitioning metadata
given when it is created (`nnx.Param(value, out_sharding=("expert", "embed", "mlp"),
eager_sharding=False)`: `cmoe_jax.moe.params.with_axes`, used by the decoder's and the MoE
layers' modules alike); a module of one's own may instead declare them in a class attribute
`LOGICAL_AXES = {"w": ("embed", "mlp"), ...}`. One rules table, `RULES`,
maps each logical axis to the mesh axes it may be split over, in order of preference:
projections are split Megatron-style over "model" (columns of q/k/v/gate/up, rows of
o/down), stacked experts over "expert" when the mesh has that axis and over "model"
otherwise; stacked decoder layers (`cmoe_jax.models.stack`) add a leading "layers" axis,
never split. A mesh axis is used at most once per array, and only where it divides the
dimension (else that dimension stays whole). A variable whose module declares no axes for
it is an error, never a silent replication. LoRA adapters (`cmoe_jax.lora_variables`) take their
axes from the weight they adapt.
"""
from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cmoe_jax.errors import CmoeError
from cmoe_jax.lora_variables import adapter_axes

# logical axis -> mesh axes it may be split over, first usable one wins
RULES: dict[str | None, tuple[str, ...]] = {
    None: (),
    "batch": ("data",),
    "embed": (),          # the residual width stays whole: activations are split by tokens
    "vocab": ("model",),
    "heads": ("model",),
    "kv_heads": ("model",),
    "mlp": ("model",),
    "expert": ("expert", "model"),
    "router": (),         # the CMoE / linear router's small [d, E*r] tables
    "norm": (),           # RMSNorm scales
    "layers": (),         # the leading axis of stacked decoder layers: each device holds all
}


class ShardingError(CmoeError):
    """A variable without declared logical axes, or a mesh that cannot be built."""


def make_mesh(data: int | None = None, model: int = 1, *, expert: int = 1, devices=None) -> Mesh:
    """A ("data", "model") mesh, with an "expert" axis in between when `expert > 1`.

    `data` defaults to every device left over by the other axes (this process's devices,
    `jax.local_devices()`: meshes never span processes, see `cmoe_jax.distributed`, unless
    `devices` is given); the mesh uses the first data * expert * model devices.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    if data is None:
        data = len(devices) // (model * expert)
    need = data * model * expert
    if need > len(devices) or min(data, model, expert) < 1:
        raise ShardingError(f"a mesh of {data} x {expert} x {model} (data x expert x model) "
                            f"devices needs {max(need, 1)} devices, {len(devices)} available")
    if expert > 1:
        return Mesh(np.array(devices[:need]).reshape(data, expert, model),
                    ("data", "expert", "model"))
    return Mesh(np.array(devices[:need]).reshape(data, model), ("data", "model"))


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """Mesh axes a batch is split over: "data", and "expert" too (outside the routed experts
    the expert axis is one more data-parallel axis; inside them, tokens move by all-to-all)."""
    return tuple(a for a in ("data", "expert") if a in mesh.axis_names)


def spec_for(axes: tuple, shape: tuple, mesh: Mesh) -> P:
    """PartitionSpec of an array of `shape` whose dimensions have the logical `axes`."""
    if len(axes) != len(shape):
        raise ShardingError(f"logical axes {axes} do not match an array of shape {shape}")
    sizes, used, spec = dict(mesh.shape), set(), []
    for name, dim in zip(axes, shape):
        if name not in RULES:
            raise ShardingError(f"logical axis {name!r} has no rule in cmoe_jax.sharding.RULES")
        pick = next((a for a in RULES[name] if a not in used and sizes.get(a, 1) > 1
                     and dim % sizes[a] == 0), None)
        if pick is not None:
            used.add(pick)
        spec.append(pick)
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def declared_axes(module) -> dict:
    """A module's logical axes by variable name: those its variables were created with
    (partitioning metadata `out_sharding`), over its class's `LOGICAL_AXES`."""
    own = {name: axes for name, var in vars(module).items()
           if isinstance(var, nnx.Variable) and (axes := var.get_metadata().get("out_sharding")) is not None}
    return {**getattr(type(module), "LOGICAL_AXES", {}), **own}


def logical_axes(model: nnx.Module) -> dict[tuple, tuple]:
    """{state path: logical axes} of every variable of `model` (concrete or abstract)."""
    modules, variables = {}, []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            modules[tuple(path)] = node
        elif isinstance(node, nnx.Variable):
            variables.append(tuple(path))
    out = {}
    for path in variables:
        owner = modules.get(path[:-1])
        declared = declared_axes(owner)
        axes = declared.get(path[-1]) or adapter_axes(str(path[-1]), declared)
        if axes is None:
            raise ShardingError(f"variable {'/'.join(map(str, path))} of "
                                f"{type(owner).__name__} has no logical axes: create it with "
                                f"them (out_sharding metadata) or declare them in "
                                f"{type(owner).__name__}.LOGICAL_AXES")
        stacked = [getattr(type(modules[path[:k]]), "STACKED_AXIS", None)
                   for k in range(len(path) - 1) if path[:k] in modules]
        out[path] = (*[a for a in stacked if a], *axes)  # a LayerStack's layer axis first
    return out


def shardings_of(model: nnx.Module, mesh: Mesh) -> dict[tuple, NamedSharding]:
    """{state path: NamedSharding} of every variable of `model` on `mesh`."""
    shapes = {tuple(p): v.get_value().shape for p, v in nnx.to_flat_state(nnx.state(model))}
    return {p: NamedSharding(mesh, spec_for(axes, shapes[p], mesh))
            for p, axes in logical_axes(model).items()}


def place_state(state: nnx.State, shardings: dict, value: Callable | None = None,
                largest_first: bool = False) -> nnx.State:
    """`state` with every variable's value on `shardings[path]`, one variable at a time.

    `value(path, current)` gives the array to place (default: the variable's own); a
    `jax.ShapeDtypeStruct` becomes an abstract target carrying the sharding (for restores).
    `largest_first` places the biggest variables first: a loader's temporaries for a large
    tensor (a dequantised LM head and its transposed copy) then come while little else is held.
    """
    flat = list(nnx.to_flat_state(state))
    order = sorted(flat, key=lambda pv: -int(np.prod(pv[1].get_value().shape))) if largest_first else flat
    for path, var in order:
        v = var.get_value() if value is None else value(path, var.get_value())
        sh = shardings[tuple(path)]
        var.set_value(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh)
                      if isinstance(v, jax.ShapeDtypeStruct) else jax.device_put(v, sh))
    return nnx.from_flat_state(flat)


def placed_split(model: nnx.Module, mesh: Mesh):
    """(graphdef, state on its shardings over `mesh`): what a jitted step takes."""
    graphdef, state = nnx.split(model)
    return graphdef, place_state(state, shardings_of(model, mesh))

"""Named shardings for decoder parameters over a ("data", "model") device mesh.

Projections are split Megatron-style over "model" (columns of q/k/v/gate/up, rows of o/down),
stacked experts over their leading expert axis; everything else is replicated. With no
"model" axis (or size 1) every parameter is replicated, which is what data parallelism needs.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

_COLUMN = {"q_proj", "k_proj", "v_proj", "gate", "up", "shared_gate", "shared_up", "lm_head"}
_ROW = {"o_proj", "down", "shared_down"}
_EXPERT = {"expert_gate", "expert_up", "expert_down"}


def data_mesh(devices=None) -> Mesh:
    """A 1-D mesh over all local devices for data parallelism."""
    devices = jax.local_devices() if devices is None else devices
    return Mesh(np.array(devices), ("data",))


def param_spec(path: tuple, shape: tuple, mesh: Mesh) -> P:
    size = dict(mesh.shape).get("model", 1)
    leaf = next((p for p in reversed(path) if isinstance(p, str)), "")
    if size > 1:
        if leaf in _EXPERT and shape[0] % size == 0:
            return P("model", *([None] * (len(shape) - 1)))
        if leaf in _COLUMN and len(shape) == 2 and shape[1] % size == 0:
            return P(None, "model")
        if leaf in _ROW and len(shape) == 2 and shape[0] % size == 0:
            return P("model", None)
    return P()


def param_sharding(path: tuple, shape: tuple, mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, param_spec(path, shape, mesh))

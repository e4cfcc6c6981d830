"""Turn scope plans into models: the prototype runtime, or the paper's copied checkpoint.

`apply_plans` gives a Decoder whose compressed layers store only their scope's prototype
table (`MoEFFN(num_prototypes=K)`, the table tied across the scope's layers) plus slot maps;
`materialize` gives the original architecture with every slot holding its prototype's
weights (the paper's evaluation checkpoint; no memory saved), the reference the runtime must
equal. `routed_bytes` counts the routed-expert bytes a model really holds.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from cmoe_jax.methods.conmoe.plan import PROJECTIONS, unit_weights
from cmoe_jax.models import Decoder
from cmoe_jax.models.stack import each_layer, layered_state
from cmoe_jax.moe.prototypes import DUPLICATE_GATES


def prototype_tables(model, plan) -> dict[str, np.ndarray]:
    """`{name: [K, ...]}` tables of one scope plan (`mix @ units`, `unit_weights` layout; each
    unit's neurons first put in the plan's order where it has one: `perms[e]` is `[m]`, or
    `[S, m]` with one order per sub-expert)."""
    ws = unit_weights(model, plan.layers)
    for e, perm in (plan.perms or {}).items():
        perm = np.atleast_2d(perm)
        for name in ("expert_gate", "expert_up"):
            ws[name][e] = np.take_along_axis(ws[name][e], perm[:, None, :], axis=2)
        ws["expert_down"][e] = np.take_along_axis(ws["expert_down"][e], perm[:, :, None], axis=1)
    return {name: np.tensordot(plan.mix, w, axes=1).astype(np.float32) for name, w in ws.items()}


def _stored(name: str, table: np.ndarray, like) -> jnp.ndarray:
    """A table in the layer's layout: sub-experts flattened into the expert axis."""
    if name in PROJECTIONS:
        table = table.reshape(-1, *table.shape[2:])
    return jnp.asarray(table, like.dtype)


def compressed_config(cfg, plans, duplicate_gates: str = "sum"):
    specs = list(cfg.moe_layers)
    for plan in plans:
        owner = plan.layers[0] if len(plan.layers) > 1 else -1
        for l in plan.layers:
            specs[l] = dataclasses.replace(specs[l], num_prototypes=plan.num_prototypes,
                                           prototype_owner=owner, duplicate_gates=duplicate_gates)
    return cfg.with_moe_layers(specs)


def apply_plans(model, plans, duplicate_gates: str = "sum") -> Decoder:
    """The compressed Decoder (prototype runtime) of `model` under `plans`, a token's gates on
    slots sharing a prototype merged by `duplicate_gates` (`DUPLICATE_GATES`)."""
    if duplicate_gates not in DUPLICATE_GATES:
        raise ValueError(f"duplicate_gates {duplicate_gates!r} must be one of {', '.join(DUPLICATE_GATES)}")
    cfg = compressed_config(model.config, plans, duplicate_gates)
    state = nnx.to_pure_dict(layered_state(model))
    for plan in plans:
        tables = prototype_tables(model, plan)
        for l in plan.layers:
            mlp = state["layers"][l]["mlp"]
            shared = type(each_layer(model)[l][0].mlp).TABLE_NAMES
            for name, table in tables.items():
                if l == plan.layers[0] or name not in shared:
                    mlp[name] = _stored(name, table, mlp[name])
                else:  # tied to the owner's table: not a variable of this layer
                    mlp.pop(name)
            mlp["slot_map"] = jnp.asarray(plan.slot_maps[l], jnp.int32)
    return Decoder.from_pure(cfg, state, model.dtype)


def materialize(model, plans) -> Decoder:
    """The copied checkpoint: the original architecture, slot e of layer l holding its
    prototype's weights (plans without pruned slots only; it sums duplicate gates, the
    paper's rule, as every slot runs its own copy)."""
    state = nnx.to_pure_dict(layered_state(model))
    for plan in plans:
        tables = prototype_tables(model, plan)
        for l in plan.layers:
            slots = plan.slot_maps[l]
            if (slots < 0).any():
                raise ValueError("a pruned slot has no weights to copy")
            mlp = state["layers"][l]["mlp"]
            for name, table in tables.items():
                mlp[name] = _stored(name, table[slots], mlp[name])
    return Decoder.from_pure(model.config, state, model.dtype)


def state_bytes(model, names=None) -> int:
    """Bytes of the distinct arrays in `model`'s state (a tied table once), only those named
    `names` when given: what a checkpoint stores, independent of how Orbax packs it."""
    flat = nnx.to_flat_state(nnx.state(model))
    return int(sum(v.get_value().nbytes for p, v in flat if names is None or p[-1] in names))


def routed_bytes(model) -> int:
    """Bytes of the distinct routed-expert arrays in `model`'s state."""
    return state_bytes(model, PROJECTIONS)

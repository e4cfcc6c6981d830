"""Prototype experts (ConMoE): router slots that point at a smaller table of stored experts.

A layer with `num_prototypes = K` keeps its router over all E original slots but stores only
K expert weights and an int32 `slot_map [E]` (slot -> prototype, -1 for a pruned slot). The
router's selected slots are mapped to prototypes, a token's gates on slots that share a
prototype are summed onto its first occurrence (the others get weight 0), and the grouped
matmul dispatch then runs on the K prototypes: the result is the copied checkpoint's
(`sum_i g_i * expert_{slot_map[i]}(x)`) while only K experts live in memory. Layers of one
cross-layer scope share one table: the Decoder ties their weight variables to the table of
the scope's first layer (`tie_prototype_tables`), so state and checkpoint hold it once.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

TABLE_NAMES = ("expert_gate", "expert_up", "expert_down")


class SlotMap(nnx.Variable):
    """int32 `[E]` router slot -> prototype index (-1: pruned); state, never trained."""


def to_prototypes(ids: jax.Array, gates: jax.Array, slot_map: jax.Array):
    """(prototype ids int32 `[T, k]`, merged gates float32 `[T, k]`) for slot ids `[T, k]`.

    Pruned slots get weight 0; slots mapping to the same prototype within a token have
    their gates summed onto the first of them (the duplicates keep weight 0)."""
    proto = slot_map[ids]
    gates = jnp.where(proto >= 0, gates.astype(jnp.float32), 0.0)
    proto = jnp.maximum(proto, 0).astype(jnp.int32)
    same = proto[:, :, None] == proto[:, None, :]                      # [T, k, k]
    k = ids.shape[1]
    earlier = jnp.tril(jnp.ones((k, k), bool), -1)                     # j < i
    first = ~jnp.any(same & earlier[None], axis=-1)                    # no earlier duplicate
    merged = jnp.einsum("tij,tj->ti", same.astype(jnp.float32), gates)
    return proto, jnp.where(first, merged, 0.0)


def tie_prototype_tables(layers, specs) -> None:
    """Point each layer's prototype table (`TABLE_NAMES` of its FFN class) at its scope
    owner's (in place)."""
    for i, spec in enumerate(specs):
        owner = -1 if spec is None else spec.prototype_owner
        if owner >= 0 and owner != i:
            for name in getattr(layers[i].mlp, "TABLE_NAMES", TABLE_NAMES):
                setattr(layers[i].mlp, name, getattr(layers[owner].mlp, name))

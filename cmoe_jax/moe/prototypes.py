"""Prototype experts (ConMoE): router slots that point at a smaller table of stored experts.

A layer with `num_prototypes = K` keeps its router over all E original slots but stores only
K expert weights and an int32 `slot_map [E]` (slot -> prototype, -1 for a pruned slot). The
router's selected slots are mapped to prototypes, a token's gates on slots that share a
prototype are merged onto its first occurrence (the others get weight 0), and the grouped
matmul dispatch then runs on the K prototypes. The paper's rule "sum" gives the copied
checkpoint's result (`sum_i g_i * expert_{slot_map[i]}(x)`) while only K experts live in
memory; "max" keeps the largest of the duplicate gates (a prototype counts once, as if the
token had chosen it once), "renorm" keeps the largest and rescales the token's distinct
prototypes so their gates add up to the token's original total (the mass of the dropped
duplicates spread over what remains). Layers of one
cross-layer scope share one table: the Decoder ties their weight variables to the table of
the scope's first layer (`tie_prototype_tables`), so state and checkpoint hold it once.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

TABLE_NAMES = ("expert_gate", "expert_up", "expert_down")
DUPLICATE_GATES = ("sum", "max", "renorm")


class SlotMap(nnx.Variable):
    """int32 `[E]` router slot -> prototype index (-1: pruned); state, never trained."""


def to_prototypes(ids: jax.Array, gates: jax.Array, slot_map: jax.Array, rule: str = "sum"):
    """(prototype ids int32 `[T, k]`, merged gates float32 `[T, k]`) for slot ids `[T, k]`.

    Pruned slots get weight 0; slots mapping to the same prototype within a token have
    their gates merged by `rule` (`DUPLICATE_GATES`) onto the first of them (the duplicates
    keep weight 0)."""
    if rule not in DUPLICATE_GATES:
        raise ValueError(f"duplicate-gate rule {rule!r} must be one of {', '.join(DUPLICATE_GATES)}")
    proto = slot_map[ids]
    valid = proto >= 0
    gates = jnp.where(valid, gates.astype(jnp.float32), 0.0)
    proto = jnp.maximum(proto, 0).astype(jnp.int32)
    same = (proto[:, :, None] == proto[:, None, :]) & valid[:, :, None] & valid[:, None, :]  # [T, k, k]
    k = ids.shape[1]
    earlier = jnp.tril(jnp.ones((k, k), bool), -1)                     # j < i
    first = valid & ~jnp.any(same & earlier[None], axis=-1)            # no earlier duplicate
    if rule == "sum":
        merged = jnp.einsum("tij,tj->ti", same.astype(jnp.float32), gates)
    else:
        merged = jnp.max(jnp.where(same, gates[:, None, :], -jnp.inf), axis=-1)
        merged = jnp.where(first, merged, 0.0)
        if rule == "renorm":
            kept = jnp.sum(merged, axis=-1, keepdims=True)
            total = jnp.sum(gates, axis=-1, keepdims=True)
            merged = merged * jnp.where(kept != 0, total / jnp.where(kept != 0, kept, 1.0), 1.0)
    return proto, jnp.where(first, merged, 0.0)


def tie_prototype_tables(layers, specs) -> None:
    """Point each layer's prototype table (`TABLE_NAMES` of its FFN class) at its scope
    owner's (in place)."""
    for i, spec in enumerate(specs):
        owner = -1 if spec is None else spec.prototype_owner
        if owner >= 0 and owner != i:
            for name in getattr(layers[i].mlp, "TABLE_NAMES", TABLE_NAMES):
                setattr(layers[i].mlp, name, getattr(layers[owner].mlp, name))

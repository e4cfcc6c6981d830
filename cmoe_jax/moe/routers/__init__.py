"""Routers: which `top_k` experts each token uses and with what gate weight.

Each kind is a `Router` unit in its own module (`base.py` says what a unit holds), found
by name in `ROUTERS`:

- "linear" (Qwen3-MoE, Mixtral, ExpertWeaver): softmax gates over `x @ W_r`;
- "cmoe" (CMoE): the experts' representative neurons, balancing bias, gates `1 + s' u`;
- "topsum" (ExpertWeaver, training-free): top-k of `x @ W_r`, gates 1;
- "sum": every expert, gates 1 (the dense FFN split into experts).

A new kind: a module with its `Router` subclass, and one line below (or
`register_router(MyRouter())` from user code). Guide: docs/guides/adding-a-router.md.
"""
from __future__ import annotations

from importlib.metadata import entry_points

import jax
import jax.numpy as jnp

from cmoe_jax.moe.routers.base import Router, RouterParam, Routing
from cmoe_jax.moe.routers.cmoe import CmoeRouter, cmoe_choice, cmoe_route, cmoe_scores
from cmoe_jax.moe.routers.linear import LinearRouter, linear_route
from cmoe_jax.moe.routers.sum import SumRouter, sum_route
from cmoe_jax.moe.routers.topsum import TopSumRouter, topsum_route

ROUTERS: dict[str, Router] = {r.name: r for r in (CmoeRouter(), LinearRouter(), SumRouter(), TopSumRouter())}
ROUTER_KINDS = tuple(ROUTERS)  # the built-in kinds
RouterKind = str  # a name in ROUTERS
ENTRY_POINTS = "cmoe_jax.routers"  # where other packages declare their routers


def register_router(unit: Router) -> Router:
    """Make `unit` available by its name to `MoEFFN(router=...)`, configs and the export."""
    if not isinstance(unit, Router):
        raise TypeError(f"{unit!r} is not a cmoe_jax.moe.routers.Router")
    ROUTERS[unit.name] = unit
    return unit


def get_router(name: str) -> Router:
    """The unit of router kind `name`: a registered one, or one a package declares under the
    entry-point group "cmoe_jax.routers" (loaded on first use); ValueError otherwise."""
    if name not in ROUTERS:
        found = entry_points(group=ENTRY_POINTS, name=name)
        for point in found:
            register_router(point.load()())
        if name not in ROUTERS:
            raise ValueError(f"router must be one of {tuple(ROUTERS)}, got {name!r} (a router "
                             f"of another package registers under the entry points {ENTRY_POINTS!r})")
    return ROUTERS[name]


def router_logits(unit: Router, x, arrays: dict, routing: Routing, keep=None) -> jax.Array:
    """A router's float32 logits `[T, E]` (-inf for pruned slots; `[0, E]` for no tokens)."""
    if x.shape[0] == 0:
        return jnp.zeros((0, routing.num_experts), jnp.float32)
    logits = unit.logits(x.astype(jnp.float32), arrays, routing)
    return logits if keep is None else jnp.where(keep, logits, -jnp.inf)


__all__ = ["Router", "RouterParam", "Routing", "ROUTERS", "ROUTER_KINDS", "RouterKind",
           "register_router", "get_router", "router_logits", "cmoe_choice", "cmoe_route", "cmoe_scores", "linear_route",
           "sum_route", "topsum_route"]

"""Pure-dict helpers that hold a model's layers in its layout: stacked leaf by leaf, each
per-layer piece dropped as soon as it is stacked, and the parts (stack, runs, listed layers)
a layout is made of, and the state paths of a layer in them."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx, traverse_util

from cmoe_jax.models.stack import STACKED, LayerRuns, LayerStack


def _stack_consuming(modules: list) -> dict:
    """The modules' states stacked on a new leading axis (a pure dict), one variable at a
    time, each per-module array released as soon as it is stacked (`modules` is emptied)."""
    trees = [nnx.to_pure_dict(nnx.state(m)) for m in modules]
    modules.clear()
    return _stack_pure(trees)


def _stack_pure(trees: list) -> dict:
    """Pure dicts of one structure stacked on a new leading axis, one leaf at a time, each
    tree's leaf dropped as soon as it is stacked (`trees` is emptied)."""
    flats = [traverse_util.flatten_dict(t) for t in trees]
    trees.clear()
    stacked = {}
    for path in list(flats[0]):
        stacked[path] = jnp.stack([flat.pop(path) for flat in flats])
    return traverse_util.unflatten_dict(stacked)


def _layout(layers) -> tuple | None:
    """How layers are held: ("stack",), LayerRuns' run sizes, or None for listed layers."""
    if isinstance(layers, LayerStack):
        return ("stack",)
    return layers.sizes() if isinstance(layers, LayerRuns) else None


def _parts(pure_layers: dict, layers) -> list[tuple[list[int], dict]]:
    """(its layers' indices, its pure dict: stacked when it holds two or more) for each part
    of `layers` held as one: the stack, each run of LayerRuns, each listed layer."""
    if isinstance(layers, LayerStack):
        return [(list(range(len(layers))), pure_layers[STACKED])]
    if isinstance(layers, LayerRuns):
        return [(list(range(first, first + size)), pure_layers["runs"][r][STACKED] if size > 1 else pure_layers["runs"][r])
                for r, (first, size) in enumerate(zip(layers.starts(), layers.sizes()))]
    return [([i], pure_layers[i]) for i in range(len(layers))]


def layer_path(model, i: int) -> tuple:
    """The state path of the module holding layer `i`'s variables: `("layers", i)`, or its
    stack's stacked layer (`("layers", "stacked")`, `("layers", "runs", r, "stacked")`)."""
    layers = model.layers
    if isinstance(layers, LayerStack):
        return ("layers", STACKED)
    if isinstance(layers, LayerRuns):
        r, j = layers.locate(i)
        return ("layers", "runs", r) + (() if j is None else (STACKED,))
    return ("layers", i % len(layers))


def per_layer_paths(layers, path: tuple) -> tuple[list[tuple], bool]:
    """(the per-layer state paths `("layers", i, ...)` that `path`, a state path of a model
    whose layers are `layers`, holds; whether it holds them stacked on its leading axis)."""
    if path[:2] == ("layers", STACKED):
        return [("layers", i, *path[2:]) for i in range(len(layers))], True
    if path[:2] == ("layers", "runs") and isinstance(layers, LayerRuns):
        r = path[2]
        start, size = layers.starts()[r], layers.sizes()[r]
        if size > 1:
            return [("layers", start + j, *path[4:]) for j in range(size)], True
        return [("layers", start, *path[3:])], False
    return [path], False

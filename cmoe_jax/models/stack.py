"""Decoder layers of one structure, stored stacked and run as one `lax.scan`.

When every layer of a model has the same structure (dense models, uniformly converted or
compressed ones), `Decoder.layers` is a `LayerStack`: one `DecoderLayer` whose variables all
carry a leading layer axis (state paths `("layers", "stacked", "attn", "q_proj")`, shape
`[L, d, n]`). The forward scans over that axis, so jit traces and compiles one layer, and a
train step reads the weights where they lie (no restacking, no copy). Models whose layers
differ (a partly converted model, ConMoE scopes that share tables across layers) keep an
`nnx.List` of layers, run unrolled.

Checkpoints on disk stay per layer (`layered_state`), the format streamed jobs write one
layer at a time; `stack_state` / `LayerStack.from_layers` stack them when a model is built.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from cmoe_jax.models.kv_cache import LayerCache

STACKED = "stacked"  # LayerStack's attribute holding the stacked layer; a state path key


class LayerStack(nnx.Module):
    """`size` layers of one structure as one layer with a leading layer axis on every variable.

    Indexing gives a layer's view (a new module over slices of the stacked arrays): reading it
    is fine, changing it changes nothing here; build a new model to change layers.
    """

    STACKED_AXIS = "layers"  # logical axis of the leading dimension (`cmoe_jax.sharding`)

    def __init__(self, stacked: nnx.Module, size: int):
        self.stacked = stacked
        self.size = size

    @classmethod
    def from_layers(cls, layers) -> "LayerStack":
        graphdef, states = _split_all(layers)
        return cls(nnx.merge(graphdef, stack_trees(states)), len(layers))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> nnx.Module:
        if not -self.size <= i < self.size:
            raise IndexError(f"layer {i} of {self.size}")
        graphdef, state = nnx.split(self.stacked)
        return nnx.merge(graphdef, jax.tree.map(lambda a: _layer_slice(a, i % self.size), state))

    def __iter__(self):
        return (self[i] for i in range(self.size))

    def scan(self, h, rope, *, key=None, segments=None, remat=False, capture=False, cache=None,
             slot=None):
        """(h after the last layer, FFN inputs [L, ...] or None, expert loads [L, E] or None).

        Layer i's dropout key is `fold_in(key, i)`, as in the unrolled forward. With `cache`
        (a `KVCache`, the step's tokens at slots `slot...`) the second item is the new keys
        and values `([L, B, T, K, H], same)` instead of the FFN inputs."""
        graphdef, state = nnx.split(self.stacked)
        cached = cache is not None
        kv = (cache.k, cache.v) if cached else (None, None)

        def step(h, xs):
            weights, i, k_layer, v_layer = xs
            k = None if key is None else jax.random.fold_in(key, i)
            view = LayerCache(k_layer, v_layer, cache.valid, slot) if cached else None
            h, x, load = nnx.merge(graphdef, weights)(h, rope, k, segments, view)
            return h, (x if capture or cached else None, load)

        step = jax.checkpoint(step) if remat else step
        h, (inputs, loads) = jax.lax.scan(step, h, (state, jnp.arange(self.size), *kv))
        return h, inputs, loads


def _split_all(layers):
    splits = [nnx.split(layer) for layer in layers]
    return splits[0][0], [s for _, s in splits]


def stack_trees(trees):
    """One tree whose leaves are the given trees' leaves stacked on a new leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def stackable(layers, h: jax.ShapeDtypeStruct, rope) -> bool:
    """Whether `layers` (two or more) share one structure, variable for variable, none shares
    a variable with another (ConMoE scope tables), and a layer keeps its input's dtype (a scan
    carry cannot change it): `h` a residual stream's shape and dtype, `rope` its tables."""
    if len(layers) < 2:
        return False
    splits = [nnx.split(layer) for layer in layers]
    shapes = lambda st: jax.tree.map(lambda a: (a.shape, a.dtype), st)
    first = (splits[0][0], shapes(splits[0][1]))
    if any((g, shapes(s)) != first for g, s in splits[1:]):
        return False
    ids = [id(v) for l in layers for _, v in nnx.iter_graph(l) if isinstance(v, nnx.Variable)]
    if len(ids) != len(set(ids)):
        return False
    return jax.eval_shape(lambda h: layers[0](h, rope)[0], h).dtype == h.dtype


def _layer_slice(a: jax.Array, i: int) -> jax.Array:
    """`a[i]` with the index as an operand: one compiled slice per shape, not per index."""
    return jax.lax.dynamic_index_in_dim(a, jnp.asarray(i, jnp.int32), 0, keepdims=False)


def layered_state(model) -> nnx.State:
    """`nnx.state(model)` with the layers per index (`state["layers"][i]`) whatever the
    storage: the layout of checkpoints, exports and per-layer surgery (slices are copies)."""
    state = nnx.state(model)
    layers = getattr(model, "layers", None)
    if not isinstance(layers, LayerStack):
        return state
    stacked = state["layers"][STACKED]
    per_layer = {i: jax.tree.map(lambda a, i=i: _layer_slice(a, i), stacked)
                 for i in range(layers.size)}
    out = {k: v for k, v in state.items() if k != "layers"}
    out["layers"] = nnx.State(per_layer)
    return nnx.State(out)


def each_layer(model) -> list[tuple[nnx.Module, bool]]:
    """`(module, stacked)` for every decoder layer, copying nothing: the layer itself, or a
    LayerStack's stacked layer (`stacked` True: its variables carry the leading layer axis).
    For reading structure (which weights exist, their shapes) without slicing every layer."""
    layers = model.layers
    if isinstance(layers, LayerStack):
        return [(layers.stacked, True)] * len(layers)
    return [(layer, False) for layer in layers]


def layered_pure(model) -> dict:
    """`layered_state` as a pure dict (`pure["layers"][i]["mlp"]`): what per-layer surgery
    edits before `Decoder.from_pure` builds the new model."""
    return nnx.to_pure_dict(layered_state(model))


def layer_value(model, i: int, *attrs: str) -> jax.Array:
    """The value of layer `i`'s variable at attribute path `attrs` (e.g. `"mlp", "u"`),
    slicing only that variable when the layers are stacked."""
    node, stacked = each_layer(model)[i]
    for attr in attrs:
        node = getattr(node, attr)
    return node[...][i] if stacked else node[...]

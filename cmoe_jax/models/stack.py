"""Decoder layers of one structure, stored stacked and run as one `lax.scan`.

Editing one layer goes through `Decoder.set_layer(i, layer)` (it works the same on stacked
and listed layers); `model.layers[i]` of a stack is a read-only view whose writes raise.

When every layer of a model has the same structure (dense models, uniformly converted or
compressed ones), `Decoder.layers` is a `LayerStack`: one `DecoderLayer` whose variables all
carry a leading layer axis (state paths `("layers", "stacked", "attn", "q_proj")`, shape
`[L, d, n]`). The forward scans over that axis, so jit traces and compiles one layer, and a
train step reads the weights where they lie (no restacking, no copy). Models whose layers
differ keep consecutive layers of one structure stacked: `LayerRuns` holds each such run
(two or more layers) as a `LayerStack` and any other layer as a module of its own, and the
forward scans each run and calls each lone layer, so a layer-adaptive conversion whose
shapes repeat compiles and runs close to a uniform one. Models with no such run (and ConMoE
scopes, whose layers share tables) keep an `nnx.List` of layers, run unrolled.

Checkpoints on disk stay per layer (`layered_state`), the format streamed jobs write one
layer at a time; `stack_state` / `LayerStack.from_layers` stack them when a model is built.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from cmoe_jax.models.kv_cache import LayerCache
from cmoe_jax.models.layer_views import LayerViewError, read_only  # noqa: F401  (LayerViewError: its home before)
from cmoe_jax.moe.modes import sliced_weights

STACKED = "stacked"  # LayerStack's attribute holding the stacked layer; a state path key


class LayerStack(nnx.Module):
    """`size` layers of one structure as one layer with a leading layer axis on every variable.

    Indexing gives a layer's view (a new module over slices of the stacked arrays): reading it
    is fine; writing to it raises `LayerViewError` (it would change a copy, not the stack):
    change a layer with `Decoder.set_layer`.
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
        return read_only(nnx.merge(graphdef, jax.tree.map(lambda a: _layer_slice(a, i % self.size), state)))

    def set(self, i: int, layer: nnx.Module) -> None:
        """Write `layer` (of the stack's structure) into position `i` of the stacked arrays."""
        flat = nnx.to_flat_state(nnx.state(self.stacked))
        new = dict(nnx.to_flat_state(nnx.state(layer)))
        if set(new) != {path for path, _ in flat}:
            raise ValueError(f"layer {i} does not have the structure of the stacked layers")
        for path, var in flat:
            value = new[path].get_value()
            if value.shape != var.get_value().shape[1:]:
                raise ValueError(f"layer {i}: {'/'.join(map(str, path))} has shape {value.shape}, "
                                 f"the stacked layers {var.get_value().shape[1:]}")
            var.set_value(var.get_value().at[i % self.size].set(value.astype(var.get_value().dtype)))
        nnx.update(self.stacked, nnx.from_flat_state(flat))

    def __iter__(self):
        return (self[i] for i in range(self.size))

    def scan(self, h, rope, *, keys=None, segments=None, remat=False, capture=False, cache=None,
             slot=None):
        """(h after the last layer, FFN inputs [L, ...] or None, expert loads [L, E] or None).

        `keys [L]`: each layer's dropout key (the model's `fold_in(key, layer index)`, as in
        the unrolled forward; None: no dropout). With `cache`
        (a `KVCache`, the step's tokens at slots `slot...`) the second item is the new keys
        and values `([L, B, K, T, H], same)` instead of the FFN inputs."""
        graphdef, state = nnx.split(self.stacked)
        cached = cache is not None
        kv = (cache.k, cache.v) if cached else (None, None)

        def step(h, xs):
            weights, k, k_layer, v_layer = xs
            view = LayerCache(k_layer, v_layer, cache.valid, slot) if cached else None
            with sliced_weights():  # the layer's weights are slices of the stack's
                out = nnx.merge(graphdef, weights)(h, rope, k, segments, view)
            return out.h, (out.kv if cached else out.ffn_input if capture else None, out.load)

        step = jax.checkpoint(step) if remat else step
        h, (inputs, loads) = jax.lax.scan(step, h, (state, keys, *kv))
        return h, inputs, loads


class LayerRuns(nnx.Module):
    """Layers that differ, in order: each run of two or more consecutive layers of one
    structure a `LayerStack`, any other layer a module of its own (`runs`). Indexing and
    iterating give layers as an `nnx.List` does (a stacked one as its read-only view)."""

    def __init__(self, runs: list):
        self.runs = nnx.List(runs)

    def sizes(self) -> tuple[int, ...]:
        """Layers per run (1 for a layer of its own)."""
        return tuple(len(r) if isinstance(r, LayerStack) else 1 for r in self.runs)

    def starts(self) -> tuple[int, ...]:
        """The model's index of each run's first layer."""
        sizes = self.sizes()
        return tuple(sum(sizes[:r]) for r in range(len(sizes)))

    def locate(self, i: int) -> tuple[int, int | None]:
        """(run holding layer `i`, its position in that stack, or None for a layer of its own)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"layer {i} of {n}")
        i %= n
        for r, (start, size) in enumerate(zip(self.starts(), self.sizes())):
            if i < start + size:
                return r, (i - start if isinstance(self.runs[r], LayerStack) else None)
        raise AssertionError("unreachable")

    def __len__(self) -> int:
        return sum(self.sizes())

    def __getitem__(self, i: int) -> nnx.Module:
        r, j = self.locate(i)
        return self.runs[r] if j is None else self.runs[r][j]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def set(self, i: int, layer: nnx.Module) -> None:
        """Write `layer` as layer `i`: into its stack (ValueError when the structure differs)
        or in place of a layer of its own."""
        r, j = self.locate(i)
        if j is None:
            self.runs[r] = layer
        else:
            self.runs[r].set(j, layer)


def runs_of(layers: list, h: jax.ShapeDtypeStruct, rope) -> list[list[int]]:
    """`layers` (listed) cut into runs of consecutive indices: each run of two or more layers
    can be stacked (`stackable`), every other index stands alone. A layer sharing a variable
    with another one (ConMoE scope tables) stands alone."""
    ids = [{id(v) for _, v in nnx.iter_graph(l) if isinstance(v, nnx.Variable)} for l in layers]
    shared = {i for i in range(len(layers))
              if any(ids[i] & ids[j] for j in range(len(layers)) if j != i)}
    shapes = lambda st: jax.tree.map(lambda a: (a.shape, a.dtype), st)
    keys = []
    for i, layer in enumerate(layers):
        graphdef, state = nnx.split(layer)
        keys.append(None if i in shared else (graphdef, shapes(state)))
    runs: list[list[int]] = []
    for i, key in enumerate(keys):
        if runs and key is not None and keys[runs[-1][-1]] == key:
            runs[-1].append(i)
        else:
            runs.append([i])
    out = []
    for run in runs:  # a run whose layer changes its input's dtype cannot be a scan carry
        if len(run) > 1 and not stackable([layers[i] for i in run[:2]], h, rope):
            out.extend([i] for i in run)
        else:
            out.append(run)
    return out


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


def layer_state(model, i: int) -> nnx.State:
    """`layered_state(model)["layers"][i]` alone: a slice (copied) when the layers are
    stacked; a variable several layers share (a ConMoE scope's table) is in its first
    layer's state only, as in the whole model's state."""
    layers = model.layers
    if isinstance(layers, LayerStack):
        stacked = nnx.state(layers.stacked)
        return jax.tree.map(lambda a: _layer_slice(a, i % layers.size), stacked)
    if isinstance(layers, LayerRuns):
        r, j = layers.locate(i)
        run = layers.runs[r]
        if j is None:
            return nnx.state(run)
        return jax.tree.map(lambda a: _layer_slice(a, j), nnx.state(run.stacked))
    return nnx.state(model)["layers"][i]


def layered_state(model, skip: str | None = None) -> nnx.State:
    """`nnx.state(model)` with the layers per index (`state["layers"][i]`) whatever the
    storage: the layout of checkpoints, exports and per-layer surgery (slices are copies).
    `skip`: a layer attribute (e.g. "mlp") left out of every layer, so it is not copied."""
    state = nnx.state(model)
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (LayerStack, LayerRuns)):
        if skip is not None:
            for layer in state["layers"].values():
                layer.pop(skip, None)
        return state
    drop = lambda st: nnx.State({k: v for k, v in st.items() if k != skip})
    if isinstance(layers, LayerStack):
        runs = [(0, layers.size, state["layers"][STACKED])]
    else:
        held = state["layers"]["runs"]
        runs = [(start, size, held[r][STACKED] if size > 1 else held[r]) for r, (start, size)
                in enumerate(zip(layers.starts(), layers.sizes()))]
    per_layer = {}
    for start, size, run in runs:  # (first layer, layers, their state: stacked, a stack being 2+)
        run = drop(run)
        if size == 1:
            per_layer[start] = run
        else:
            per_layer.update({start + j: jax.tree.map(lambda a, j=j: _layer_slice(a, j), run)
                              for j in range(size)})
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
    if isinstance(layers, LayerRuns):
        return [pair for run in layers.runs for pair in
                ([(run.stacked, True)] * len(run) if isinstance(run, LayerStack) else [(run, False)])]
    return [(layer, False) for layer in layers]


def layer_position(model, i: int) -> int | None:
    """Layer `i`'s index on the leading axis of its stacked variables, or None when its
    variables are its own."""
    layers = model.layers
    if isinstance(layers, LayerStack):
        return i % layers.size
    if isinstance(layers, LayerRuns):
        return layers.locate(i)[1]
    return None


def layer_value(model, i: int, *attrs: str) -> jax.Array:
    """The value of layer `i`'s variable at attribute path `attrs` (e.g. `"mlp", "u"`),
    slicing only that variable when the layers are stacked."""
    node, _ = each_layer(model)[i]
    for attr in attrs:
        node = getattr(node, attr)
    j = layer_position(model, i)
    return node[...] if j is None else node[...][j]

"""A decoder's forward with its layers run as one `lax.scan`, so jit compiles one layer.

Unrolled, a 30-layer model compiles every layer anew for every input shape (about 20 s a shape
for SmolLM2 on a 2-core CPU); bucketed scoring compiles several shapes, so that dominates a
short evaluation. When every layer has one structure (dense models, uniformly converted ones),
the layers' weights are stacked once, outside jit, and each scan step runs the layer's own
`__call__`: the same computation as `Decoder.hidden_states`, traced once.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cmoe_jax.sharding import placed_split


class ScannedDecoder:
    """`hidden_states(tokens)` and `unembed(h)` of a Decoder, rebuilt inside jit from parts.

    Built inside jit by `merge_parts` from what `placed_parts` returns.
    """

    def __init__(self, shell, layer_graphdef, layer_stack):
        self.shell, self.layer_graphdef, self.layer_stack = shell, layer_graphdef, layer_stack

    def hidden_states(self, tokens: jax.Array, positions=None, segments=None) -> jax.Array:
        rope = self.shell.rope(tokens.shape[-1], positions)
        h = self.shell.embed_tokens(tokens)

        def step(h, weights):  # -> new residual
            return nnx.merge(self.layer_graphdef, weights)(h, rope, None, segments)[0], None

        return jax.lax.scan(step, h, self.layer_stack)[0]

    def unembed(self, h: jax.Array) -> jax.Array:
        return self.shell.unembed(h)


def scan_parts(model):
    """(shell graphdef, shell state, layer graphdef, stacked layer state), or None when the
    layers differ in structure or a layer changes its input's dtype (a scan carry cannot)."""
    layers = getattr(model, "layers", None)
    if layers is None or len(layers) < 2 or not hasattr(model, "embed_tokens"):
        return None
    splits = [nnx.split(layer) for layer in layers]
    shapes = lambda st: jax.tree.map(lambda a: (a.shape, a.dtype), st)
    if any(g != splits[0][0] or shapes(s) != shapes(splits[0][1]) for g, s in splits):
        return None
    h = jax.ShapeDtypeStruct((1, 2, model.config.hidden_size), model.dtype)
    out = jax.eval_shape(lambda h: layers[0](h, model.rope(2))[0], h)
    if out.dtype != h.dtype:
        return None
    stack = jax.tree.map(lambda *xs: jnp.stack(xs), *[s for _, s in splits])
    shell = nnx.merge(*nnx.split(model))  # a new module over the same arrays
    shell.layers = nnx.List([])
    return (*nnx.split(shell), splits[0][0], stack)


def placed_parts(model, mesh: Mesh, scan_layers: bool = True):
    """(graphdefs, states) to pass through jit (graphdefs static), parameters placed on `mesh`:
    the scanned form when the layers allow it and the mesh has only a "data" axis to split over
    (the parameters are then replicated)."""
    data_only = all(size == 1 for name, size in dict(mesh.shape).items() if name != "data")
    parts = scan_parts(model) if scan_layers and data_only else None
    if parts is None:
        graphdef, state = placed_split(model, mesh)
        return (graphdef,), (state,)
    shell_graphdef, shell_state, layer_graphdef, stack = parts
    replicated = NamedSharding(mesh, P())
    return ((shell_graphdef, layer_graphdef),
            (jax.device_put(shell_state, replicated), jax.device_put(stack, replicated)))


def merge_parts(graphdefs, states):
    """Inside jit: the model (or its scanned form) from `placed_parts`' output."""
    if len(graphdefs) == 1:
        return nnx.merge(graphdefs[0], states[0])
    return ScannedDecoder(nnx.merge(graphdefs[0], states[0]), graphdefs[1], states[1])

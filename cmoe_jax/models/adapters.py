"""A `Decoder` carrying LoRA adapters: the adapters of a whole model put into (a copy of) it,
run by its own forward, or folded into its weights.

The adapters are a nested dict that mirrors the parameter paths:
``{"layers": {"3": {"attn": {"q_proj": {"a": A, "b": B}}, ...}}}``. A weight ``W [in, out]``
gets ``A [in, r]`` and ``B [r, out]``; stacked experts ``W [E, in, out]`` get stacked
``A [E, in, r]`` and ``B [E, r, out]``. The adapted weight is ``W + scale * A @ B``.
`with_adapters` makes them `cmoe_jax.lora_variables.LoRA` variables of the modules they adapt (the
per-module mechanism, which sits below `moe` because the MoE layers apply it), so the
model's own forward (`Decoder.run_layers`) runs them; `merge_adapters` folds them into a
copy of the weights. Which weights get adapters, and how they are trained, is `cmoe_jax.train`'s.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from cmoe_jax.lora_variables import attach
from cmoe_jax.models.stack import LayerRuns, LayerStack, each_layer, layer_value, stack_trees
from cmoe_jax.moe.params import like


@dataclasses.dataclass(frozen=True)
class AdapterSet:
    """What adapts a model: the LoRA factors (`lora`, by parameter path), the CMoE router
    scales u and selection biases b by layer (`{"3": u}`; layers missing keep the model's),
    the factors' `scale` (alpha / r) and the adapters' input dropout rate."""

    lora: dict
    u: dict = dataclasses.field(default_factory=dict)
    bias: dict = dataclasses.field(default_factory=dict)
    scale: float = 1.0
    dropout: float = 0.0


def get_adapter(adapters: dict, path: tuple):
    node = adapters
    for key in path:
        node = node.get(str(key)) if isinstance(node, dict) else None
        if node is None:
            return None
    return node


def delta(adapter: dict, scale: float) -> jax.Array:
    """The weight update `scale * A @ B` (batched over a leading expert axis), float32."""
    return scale * jnp.matmul(adapter["a"].astype(jnp.float32), adapter["b"].astype(jnp.float32))


def trains_router(mlp) -> bool:
    """A layer with gate scales u and balancing bias b (`u`, `router_bias`): one whose router
    unit trains them (`Router.trained`, the cmoe router's), or a hierarchical one (its
    sub-routers' u, b; its top-level router stays as converted)."""
    unit = getattr(mlp, "router_unit", None)
    return bool(unit is not None and unit.trained) or getattr(mlp, "sub_experts", 0) > 0


def router_params(model) -> tuple[dict, dict]:
    """The CMoE router gate scales u and selection biases b by layer: `({"3": u}, {"3": b})`.

    Fresh float32 copies, so donating them to a train step leaves the model intact.
    """
    us, bs = {}, {}
    for i, (layer, _) in enumerate(each_layer(model)):
        if trains_router(layer.mlp):
            us[str(i)] = jnp.array(layer_value(model, i, "mlp", "u"), jnp.float32, copy=True)
            bs[str(i)] = jnp.array(layer_value(model, i, "mlp", "router_bias"), jnp.float32,
                                   copy=True)
    return us, bs


def _copy(model):
    """New module objects over the same arrays (so attributes can change, not the model)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a, state))


def _per_layer(model, adapters: dict, u: dict | None, bias: dict | None):
    """`[(layer module, {"attn": .., "mlp": .., "u": .., "bias": ..})]`: what goes into each
    layer, or, for stacked layers, into the stacked layer, every layer's values stacked (u / b
    of layers missing from `u` / `bias` then come from the model)."""
    trees = {}
    for i, (layer, stacked) in enumerate(each_layer(model)):
        tree = {g: dict(get_adapter(adapters, ("layers", i, g)) or {}) for g in ("attn", "mlp")}
        for key, given, name in (("u", u, "u"), ("bias", bias, "router_bias")):
            if given and str(i) in given:
                tree[key] = jnp.asarray(given[str(i)])
            elif given and stacked:
                tree[key] = layer_value(model, i, "mlp", name)
        trees[i] = tree
    if not trees:
        return []
    if isinstance(model.layers, LayerStack):
        return [(model.layers.stacked, stack_trees(list(trees.values())))]
    if isinstance(model.layers, LayerRuns):
        return [(run.stacked, stack_trees([trees[first + j] for j in range(len(run))]))
                if isinstance(run, LayerStack) else (run, trees[first])
                for first, run in zip(model.layers.starts(), model.layers.runs)]
    return [(model.layers[i], tree) for i, tree in trees.items()]


def with_adapters(model, adapters: dict, scale: float, u: dict | None = None,
                  bias: dict | None = None, dropout: float = 0.0):
    """A copy of `model` carrying `adapters` as `LoRA` variables of the modules they adapt,
    and the router scales u / selection biases b given by layer (float32, as given; layers
    missing from them keep the model's). Traceable: the train step calls it inside `jit`;
    for stacked layers it stacks the adapters (small), never the weights."""
    out = _copy(model)
    for layer, tree in _per_layer(out, adapters, u, bias):
        for group in ("attn", "mlp"):
            for name, ab in tree[group].items():
                attach(getattr(layer, group), name, ab["a"], ab["b"], scale, dropout)
        if "u" in tree:
            layer.mlp.u = like(layer.mlp.u, tree["u"])
        if "bias" in tree:
            layer.mlp.router_bias = like(layer.mlp.router_bias, tree["bias"])
    return out


def adapted_run(model, adapters: AdapterSet, tokens: jax.Array, *, key: jax.Array | None = None,
                remat: bool = False, capture: bool = False):
    """(residual stream after the last layer of the adapted model, every layer's FFN input
    when `capture` else [], the expert loads `{layer: int32 [E]}` of its CMoE layers).
    Layer i's dropout masks come from `fold_in(key, i)` (no dropout without a key)."""
    adapted = with_adapters(model, adapters.lora, adapters.scale, adapters.u, adapters.bias,
                            adapters.dropout)
    h, inputs, loads = adapted.run_layers(tokens, key=key, remat=remat, capture=capture)
    cmoe = {str(i) for i, (layer, _) in enumerate(each_layer(model)) if trains_router(layer.mlp)}
    return h, inputs, {k: v for k, v in loads.items() if k in cmoe}


def merge_adapters(model, adapters: dict, scale: float, u: dict | None = None,
                   bias: dict | None = None):
    """A copy of `model` with `W + scale * A @ B` folded in and u / b set; `model` is unchanged."""
    merged = _copy(model)
    for layer, tree in _per_layer(merged, adapters, u, bias):
        for group in ("attn", "mlp"):
            module = getattr(layer, group)
            for name, adapter in tree[group].items():
                w = getattr(module, name)
                new = w[...].astype(jnp.float32) + delta(adapter, scale)
                setattr(module, name, like(w, new.astype(w[...].dtype)))
        mlp = layer.mlp
        if "u" in tree:
            mlp.u = like(mlp.u, tree["u"].astype(mlp.u[...].dtype))
        if "bias" in tree:
            mlp.router_bias[...] = tree["bias"].astype(mlp.router_bias[...].dtype)
    return merged

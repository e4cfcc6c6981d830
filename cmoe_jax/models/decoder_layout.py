"""How a `Decoder` holds its layers: stacked where they can be (`cmoe_jax.models.stack`),
and a converted model built from a source's embeddings, attention and norms around new FFNs
(`with_ffns`), sharing the source's arrays where the layout allows."""
from __future__ import annotations

import jax
from flax import nnx

from cmoe_jax.models.config import ModelConfig
from cmoe_jax.models.layer_parts import _layout, _parts, _stack_consuming, _stack_pure
from cmoe_jax.models.stack import STACKED, LayerRuns, LayerStack, layered_state, runs_of, stackable


def store_layers(model, layers):
    """A LayerStack of `layers` when they can be stacked; else LayerRuns when some
    consecutive ones can (`runs_of`); else an nnx.List."""
    h = jax.ShapeDtypeStruct((1, 2, model.config.hidden_size), model.dtype)
    if stackable(layers, h, model.rope(2)):
        return LayerStack.from_layers(layers)
    runs = runs_of(layers, h, model.rope(2))
    if all(len(run) == 1 for run in runs):
        return nnx.List(layers)
    return LayerRuns([LayerStack.from_layers([layers[i] for i in run]) if len(run) > 1
                      else layers[run[0]] for run in runs])



def with_ffns(model, cfg: ModelConfig, ffns: list):
    """A new model of config `cfg` (a conversion's): this model's embeddings, attention
    and norms with `ffns[i]` as layer i's FFN. Consumes `ffns` (the list is emptied):
    each FFN tensor of a stacked part is stacked and its per-layer pieces are dropped one
    tensor at a time; when the new layers are held as this model's are (one stack, or
    runs of the same sizes) this model's arrays are shared, not copied; a stacked model
    whose conversion differs per layer gives runs, stacked run by run; a model with
    listed layers gives one with listed layers (nothing copied)."""
    abstract = nnx.eval_shape(lambda: type(model)(cfg, dtype=model.dtype, rngs=nnx.Rngs(0)))
    if _layout(model.layers) is not None and _layout(model.layers) == _layout(abstract.layers):
        pure = nnx.to_pure_dict(nnx.state(model))  # the source's arrays, shared
        for idx, part in _parts(pure["layers"], model.layers):
            mine = [ffns[i] for i in idx]
            for i in idx:
                ffns[i] = None
            part["mlp"] = _stack_consuming(mine) if len(idx) > 1 else nnx.to_pure_dict(nnx.state(mine[0]))
        ffns.clear()
    else:
        listed = nnx.eval_shape(lambda: type(model)(cfg, dtype=model.dtype, rngs=nnx.Rngs(0),
                                                stack=False))
        pure = nnx.to_pure_dict(layered_state(model, skip="mlp"))
        for i, ffn in enumerate(ffns):
            pure["layers"][i]["mlp"] = nnx.to_pure_dict(nnx.state(ffn))
        ffns.clear()
        if _layout(model.layers) is not None and isinstance(abstract.layers, LayerRuns):
            per_layer, runs = pure["layers"], {}  # stacked run by run, each slice dropped
            for r, (first, size) in enumerate(zip(abstract.layers.starts(), abstract.layers.sizes())):
                taken = [per_layer.pop(first + j) for j in range(size)]
                runs[r] = taken[0] if size == 1 else {STACKED: _stack_pure(taken)}
            pure["layers"] = {"runs": runs}
        else:  # stacking listed layers would copy every one of them: they stay listed
            abstract = listed
    graphdef, target = nnx.split(abstract)
    nnx.replace_by_pure_dict(target, pure)
    return nnx.merge(graphdef, target)


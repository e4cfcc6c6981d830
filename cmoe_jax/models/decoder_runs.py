"""How a `Decoder` runs its layers: all of them on a sequence (`run_layers`, the one forward
behind evaluation, conversion and training) or one decoding step over a KV cache
(`run_cached`); stacked layers as one `lax.scan`, layers of their own one after another."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from cmoe_jax.models.kv_cache import KVCache
from cmoe_jax.models.stack import LayerRuns, LayerStack


def run_layers(model, tokens: jax.Array, *, key=None, remat: bool = False, capture: bool = False,
               positions: jax.Array | None = None, segments: jax.Array | None = None):
    """(residual stream after the last layer, every layer's FFN input when `capture`
    else [], expert loads `{layer: int32 [E]}` of the MoE layers): the one forward
    behind evaluation, conversion and training. Stacked layers run as one `lax.scan`
    (`LayerStack.scan`: the whole stack, or each of `LayerRuns`' runs), layers of their own
    one after another; the results are the same.

    `key`: dropout key of the LoRA adapters (layer i uses `fold_in(key, i)`; None: no
    dropout). `remat`: recompute each layer in the backward pass instead of storing its
    activations (training memory). `positions`/`segments` [B, T]: explicit RoPE positions
    and prefix-shared packing (`causal_attention`); None: 0..T-1, one sequence a row.
    """
    rope = model.rope(tokens.shape[-1], positions)
    h = model.embed_tokens(tokens)
    inputs, loads = [], {}
    for first, run in parts(model):
        if isinstance(run, LayerStack):
            keys = None if key is None else jax.vmap(lambda i: jax.random.fold_in(key, i))(
                first + jnp.arange(len(run)))
            h, captured, run_loads = run.scan(h, rope, keys=keys, segments=segments, remat=remat,
                                              capture=capture)
            inputs += [captured[j] for j in range(len(run))] if capture else []
            if run_loads is not None:
                loads.update({str(first + j): run_loads[j] for j in range(len(run))})
            continue
        k = None if key is None else jax.random.fold_in(key, first)
        if remat:
            graphdef, state = nnx.split(run)
            out = jax.checkpoint(
                lambda st, h, k, g=graphdef: nnx.merge(g, st)(h, rope, k, segments))(state, h, k)
        else:
            out = run(h, rope, k, segments)
        h = out.h
        if capture:
            inputs.append(out.ffn_input)
        if out.load is not None:
            loads[str(first)] = out.load
    return h, inputs, loads

def parts(model) -> list[tuple[int, nnx.Module]]:
    """(index of its first layer, a LayerStack or one layer) for each part of the layers
    that runs as one: the whole stack, each of LayerRuns' runs, or each listed layer."""
    layers = model.layers
    if isinstance(layers, LayerStack):
        return [(0, layers)]
    if isinstance(layers, LayerRuns):
        return list(zip(layers.starts(), layers.runs))
    return list(enumerate(layers))



def run_cached(model, tokens: jax.Array, positions: jax.Array, cache: KVCache, slot):
    """(residual stream [B, T, d], the cache with the step written): the forward of
    `run_layers` for T new tokens at cache slots `slot...` and RoPE `positions [B, T]`,
    attending over the cache (`cache.valid` must already mark the new slots). The cache is
    this model's layout (`empty_cache`, the one its layers run fastest with) or one
    `[L, ...]` array."""
    rope = model.rope(tokens.shape[-1], positions)
    h = model.embed_tokens(tokens)
    slot = jnp.asarray(slot, jnp.int32)
    runs = parts(model)
    if cache.per_layer and len(cache.k) != len(runs):
        raise ValueError(f"a cache of {len(cache.k)} arrays for layers that run in {len(runs)} "
                         "parts: make it with this model's empty_cache")
    news = []  # per run: its step's keys and values, or its arrays with them written in
    for r, (first, run) in enumerate(runs):
        if isinstance(run, LayerStack):
            h, kv, _ = run.scan(h, rope, cache=cache.run(r, first, len(run)), slot=slot)
        else:
            out = run(h, rope, cache=cache.layer(r if cache.per_layer else first, slot))
            h, kv = out.h, out.kv if cache.per_layer else tuple(x[None] for x in out.kv)
        news.append(kv)
    k_new, v_new = ([kv[j] for kv in news] for j in (0, 1))
    if not cache.per_layer:  # one [L, ...] array: the runs' [n, ...] parts in order
        k_new, v_new = (x[0] if len(x) == 1 else jnp.concatenate(x) for x in (k_new, v_new))
    return h, cache.write(k_new, v_new, slot)

def empty_cache(model, batch: int, length: int, dtype=None) -> KVCache:
    """An empty KV cache of `length` slots for `batch` rows: one `[L, ...]` array a
    scanned stack slices; with LayerRuns one `[n, ...]` array a run and one array a
    layer of its own; one array a layer for listed layers (`KVCache`)."""
    dtype = getattr(model, "dtype", jnp.float32) if dtype is None else dtype
    layers = model.layers
    runs = (None if isinstance(layers, LayerStack) else
            layers.sizes() if isinstance(layers, LayerRuns) else (1,) * len(layers))
    return KVCache.empty(model.config, batch, length, dtype, runs=runs)


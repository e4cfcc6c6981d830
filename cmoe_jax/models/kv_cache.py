"""A static-shape key/value cache for incremental decoding, and the attention that reads it.

The cache holds every layer's keys and values, `k/v [L, B, K, S, H]` (L layers, B rows, K kv
heads, S slots), and which slots hold a real token, `valid [B, S]`. The kv-head axis comes
before the slots so that both attention products are batched over (row, kv head) with the
cache as it lies: slots before heads made XLA:CPU transpose and copy every layer's whole cache
at every step (at batch 16 on SmolLM2, half the attention's time). All rows write the
same slots at the same step (`slot`), so a batch of prompts is left-padded to one length:
a padded slot is never valid, and each row's RoPE positions count only its real tokens
(`prompt_positions`), as `transformers` does with an attention mask. S is fixed for a jitted
step; `grow` pads it to the next length when it fills, so a long generation compiles a few
shapes only.

A model whose layers run unrolled (they differ in shape) holds the cache per layer instead, `k/v`
a tuple of L arrays `[B, K, S, H]` (`KVCache.empty(..., per_layer=True)`): each step then
updates every layer's array in place, where slices of one `[L, ...]` array written back after
the last layer make XLA copy the whole cache twice a step (at batch 16 on SmolLM2 about a
third of the step).

The decoder layers run the same modules with a `LayerCache` (`Attention.__call__`'s `cache`
argument): they attend over the cached slots plus their own new ones and hand back the new
keys and values, which `KVCache.write` stores in place (one update of the whole cache).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
    """One layer's view of the cache for a step of T new tokens written at slots
    `slot .. slot+T-1`: `k/v [B, S, K, H]` the cached slots, `valid [B, S]` (the new slots
    included), `slot` int32 scalar."""

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    slot: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer, `[L, B, K, S, H]` or (per layer) a tuple of L
    `[B, K, S, H]`, and the valid slots `[B, S]`."""

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]
    valid: jax.Array

    @classmethod
    def empty(cls, cfg, batch: int, length: int, dtype, per_layer: bool = False) -> "KVCache":
        shape = (batch, cfg.num_kv_heads, length, cfg.head_dim)
        if per_layer:
            k, v = (tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)) for _ in range(2))
        else:
            k, v = (jnp.zeros((cfg.num_layers, *shape), dtype) for _ in range(2))
        return cls(k, v, jnp.zeros((batch, length), bool))

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, tuple)

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def grow(self, length: int) -> "KVCache":
        """The same cache with `length` slots (the new ones empty)."""
        pad = length - self.length
        if pad <= 0:
            return self
        grown = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, pad), (0, 0)])  # the slot axis
        return KVCache(jax.tree.map(grown, self.k), jax.tree.map(grown, self.v),
                       jnp.pad(self.valid, ((0, 0), (0, pad))))

    def mark(self, real: jax.Array, slot) -> "KVCache":
        """The cache with slots `slot .. slot+T-1` valid where `real [B, T]` is true."""
        valid = jax.lax.dynamic_update_slice_in_dim(self.valid, real.astype(bool), slot, axis=1)
        return KVCache(self.k, self.v, valid)

    def layer(self, i, slot) -> LayerCache:
        return LayerCache(self.k[i], self.v[i], self.valid, jnp.asarray(slot, jnp.int32))

    def write(self, k_new, v_new, slot) -> "KVCache":
        """Store every layer's new keys and values (`[L, B, K, T, H]`, or a sequence of L
        `[B, K, T, H]`) at slots `slot...`."""
        if self.per_layer:
            put = lambda old, new: tuple(jax.lax.dynamic_update_slice(o, n.astype(o.dtype), (0, 0, slot, 0))
                                         for o, n in zip(old, new, strict=True))
            return KVCache(put(self.k, k_new), put(self.v, v_new), self.valid)
        k_new, v_new = (x if isinstance(x, jax.Array) else jnp.stack(list(x)) for x in (k_new, v_new))
        at = (0, 0, 0, slot, 0)
        return KVCache(jax.lax.dynamic_update_slice(self.k, k_new.astype(self.k.dtype), at),
                       jax.lax.dynamic_update_slice(self.v, v_new.astype(self.v.dtype), at),
                       self.valid)


def prompt_positions(real: jax.Array) -> jax.Array:
    """RoPE positions int32 [B, T] of left-padded rows (`real [B, T]` marks the tokens): each
    real token's index among its row's real tokens (pads get 0, they are never attended)."""
    return jnp.maximum(jnp.cumsum(real.astype(jnp.int32), axis=1) - 1, 0)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache: LayerCache, block: int = 128,
                     scale: float | None = None, window: int = 0):
    """GQA attention of the new queries `q [B, T, N, H]` (slots `slot..slot+T-1`) over the
    cache with the new keys/values `k/v [B, T, K, H]` written in: (output [B, T, N, H], the
    new (k, v) as the cache holds them, `[B, K, T, H]`). A query sees the valid slots up to
    its own and always itself (so a pad query has a finite softmax); with `window` > 0 only
    the `window` latest slots (a sliding-window layer: slots, pads included, as
    `transformers` counts cache positions). `scale` multiplies the scores (None: H ** -0.5).
    Queries go in blocks of `block`, so a long prefill's score tiles stay `[block, S]`;
    scores and softmax in float32, as `causal_attention`. Both products are batched over
    (row, kv head), the cache's leading axes, so the cache is read where it lies."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    k, v = (jnp.swapaxes(x, 1, 2).astype(cache.k.dtype) for x in (k, v))  # [B, K, T, H]: the step's
    keys = jax.lax.dynamic_update_slice_in_dim(cache.k, k, cache.slot, axis=2)
    values = jax.lax.dynamic_update_slice_in_dim(cache.v, v, cache.slot, axis=2)
    k_slot = jnp.arange(keys.shape[2])[None, :]
    qg = jnp.transpose(q.reshape(b, t, kv, n // kv, h), (0, 2, 3, 1, 4))  # [B, K, G, T, H]
    qg = qg * (h ** -0.5 if scale is None else scale)
    outs = []
    for start in range(0, t, block):
        end = min(t, start + block)
        scores = jnp.einsum("bkgth,bksh->bkgts", qg[:, :, :, start:end], keys.astype(q.dtype),
                            preferred_element_type=jnp.float32)
        q_slot = cache.slot + jnp.arange(start, end)[:, None]
        near = (k_slot <= q_slot) & ((k_slot > q_slot - window) if window else True)
        seen = (near[None] & cache.valid[:, None, :]) | (k_slot == q_slot)[None]
        p = jax.nn.softmax(jnp.where(seen[:, None, None], scores, -jnp.inf), axis=-1)
        outs.append(jnp.einsum("bkgts,bksh->bkgth", p.astype(values.dtype), values,
                               preferred_element_type=jnp.float32))
    out = jnp.concatenate(outs, axis=3) if len(outs) > 1 else outs[0]     # [B, K, G, T, H]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).astype(q.dtype).reshape(b, t, n, h), (k, v)

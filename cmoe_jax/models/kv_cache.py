"""A static-shape key/value cache for incremental decoding, and the attention that reads it.

The cache holds every layer's keys and values, `k/v [L, B, K, S, H]` (L layers, B rows, K kv
heads, S slots), and which slots hold a real token, `valid [B, S]`. The kv-head axis comes
before the slots so that both attention products are batched over (row, kv head) with the
cache as it lies: slots before heads made XLA:CPU transpose and copy every layer's whole cache
at every step. All rows write the
same slots at the same step (`slot`), so a batch of prompts is left-padded to one length:
a padded slot is never valid, and each row's RoPE positions count only its real tokens
(`prompt_positions`), as `transformers` does with an attention mask. S is fixed for a jitted
step; `grow` pads it to the next length when it fills, so a long generation compiles a few
shapes only.

A model whose layers run unrolled (they differ in shape) holds the cache per layer instead, `k/v`
a tuple of L arrays `[B K, S, H]` (`KVCache.empty(..., per_layer=True)`; rows and kv heads on
one axis): each step then updates every layer's array in place, where slices of one `[L, ...]`
array written back after the last layer make XLA copy the whole cache twice a step (at batch
16 on SmolLM2 about a third of the step).

The decoder layers run the same modules with a `LayerCache` (`Attention.__call__`'s `cache`
argument). How a layer writes its step decides whether XLA:CPU copies the cache, so each
layout has its own order: a layer of its own (`in_place`) writes its new keys and values into
its arrays, then attends over them, and hands back the arrays; a scanned layer reads its slice
of the stacked cache as it lies, attends over it and its step's own keys beside it, and hands
back only those, which `KVCache.write` stores after the last layer (one update of the whole
cache). Reading a layer's own arrays before writing them costs two whole copies of each a
step, and reading a stacked slice after writing it one. A product batched over a unit axis
makes XLA:CPU drop that axis from its operand and copy a layer's own arrays four times when
they are read after the write (the update is fused once for each shape); rows and kv heads
on one axis keep it above 1 unless both are (a model of one kv head decoding one row), and
only then do the layers of their own read first and write after, as a scanned one does
(`KVCache.in_place`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
    """One layer's view of the cache for a step of T new tokens written at slots
    `slot .. slot+T-1`: `k/v` the cached slots (`[B, K, S, H]` a slice of the stacked cache,
    `[B K, S, H]` a layer's own arrays), `valid [B, S]` (the new slots
    included), `slot` int32 scalar; `in_place`: k/v are the layer's own arrays, which the
    step is written into before attending (else a slice of the stacked cache, only read)."""

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    slot: jax.Array
    in_place: bool = dataclasses.field(default=False, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer, `[L, B, K, S, H]` or (per run of layers) a tuple of
    `[n, B, K, S, H]` (a stacked run) and `[B K, S, H]` (a layer of its own), and the valid
    slots `[B, S]`."""

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]
    valid: jax.Array

    @classmethod
    def empty(cls, cfg, batch: int, length: int, dtype, per_layer: bool = False,
              runs: tuple[int, ...] | None = None) -> "KVCache":
        """`runs`: layers per run (1: a layer of its own); `per_layer`: every layer its own."""
        runs = (1,) * cfg.num_layers if per_layer and runs is None else runs
        if runs is not None:
            if sum(runs) != cfg.num_layers:
                raise ValueError(f"runs {runs} hold {sum(runs)} layers, the model {cfg.num_layers}")
            own = (batch * cfg.num_kv_heads, length, cfg.head_dim)
            shapes = [own if n == 1 else (n, batch, cfg.num_kv_heads, length, cfg.head_dim) for n in runs]
            k, v = (tuple(jnp.zeros(shape, dtype) for shape in shapes) for _ in range(2))
        else:
            shape = (cfg.num_layers, batch, cfg.num_kv_heads, length, cfg.head_dim)
            k, v = (jnp.zeros(shape, dtype) for _ in range(2))
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

    @property
    def in_place(self) -> bool:
        """Whether a layer of its own writes its step into its arrays before attending (the
        module docstring): whenever rows times kv heads exceeds 1."""
        if not self.per_layer:
            return False
        a = self.k[0]
        return (a.shape[0] if a.ndim == 3 else a.shape[1] * a.shape[2]) > 1

    def layer(self, i, slot) -> LayerCache:
        """The view of `k[i]`, a layer's own arrays (or one layer of a stacked cache)."""
        return LayerCache(self.k[i], self.v[i], self.valid, jnp.asarray(slot, jnp.int32),
                          in_place=self.in_place and self.k[i].ndim == 3)

    def run(self, r: int, first: int, n: int) -> "KVCache":
        """The cache of the stacked run `r` of layers `first .. first+n-1`: its own `[n, ...]`
        arrays, or their slice of a stacked cache."""
        if self.per_layer:
            return KVCache(self.k[r], self.v[r], self.valid)
        return KVCache(self.k[first:first + n], self.v[first:first + n], self.valid)

    def write(self, k_new, v_new, slot) -> "KVCache":
        """The cache after a step from each array's new part: per run, the layer's own arrays
        with the step written in (`in_place`, `cached_attention`'s), kept as they are, or the
        step's own keys and values (`[B K, T, H]`, a stacked run's `[n, B, K, T, H]`); for a
        stacked cache, `[L, B, K, T, H]`. Stored at slots `slot...`."""
        if self.per_layer:
            put = lambda old, new: tuple(_store(o, n, slot, self.in_place)
                                         for o, n in zip(old, new, strict=True))
            return KVCache(put(self.k, k_new), put(self.v, v_new), self.valid)
        return KVCache(_store(self.k, k_new, slot), _store(self.v, v_new, slot), self.valid)


def _store(old: jax.Array, new: jax.Array, slot, in_place: bool = False) -> jax.Array:
    """`old` (`[B K, S, H]` or `[n, B, K, S, H]`) with the step's `new` written at `slot`;
    a layer's own arrays written in place are `new` already."""
    if in_place and old.ndim == 3:
        return new
    at = (0,) * (old.ndim - 2) + (slot, 0)
    return jax.lax.dynamic_update_slice(old, new.astype(old.dtype), at)


def prompt_positions(real: jax.Array) -> jax.Array:
    """RoPE positions int32 [B, T] of left-padded rows (`real [B, T]` marks the tokens): each
    real token's index among its row's real tokens (pads get 0, they are never attended)."""
    return jnp.maximum(jnp.cumsum(real.astype(jnp.int32), axis=1) - 1, 0)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache: LayerCache, block: int = 128,
                     scale: float | None = None, window: int = 0):
    """GQA attention of the new queries `q [B, T, N, H]` (slots `slot..slot+T-1`) over the
    cached slots and the step's keys/values `k/v [B, T, K, H]`: (output [B, T, N, H], what
    `KVCache.write` stores: the layer's arrays with the step written in when `cache.in_place`,
    else the step's own `(k, v)` in the cache's layout, `[B, K, T, H]` or `[B K, T, H]`). A query sees the valid slots up to its own
    and always itself (so a pad query has a finite softmax); with `window` > 0 only the
    `window` latest slots (a sliding-window layer: slots, pads included, as `transformers`
    counts cache positions). `scale` multiplies the scores (None: H ** -0.5). Queries go in
    blocks of `block`, so a long prefill's score tiles stay `[block, S (+ T)]`; scores and
    softmax in float32, as `causal_attention`. Both products are batched over (row, kv head),
    the cache's leading axes, with a kv head's G query heads and the block's tokens as rows,
    so the cache is read where it lies (the module docstring says why write and read are
    ordered as they are)."""
    b, t, n, h = q.shape
    kv, g = k.shape[2], n // k.shape[2]
    k, v = (jnp.swapaxes(x, 1, 2).astype(cache.k.dtype) for x in (k, v))  # [B, K, T, H]
    if cache.k.ndim == 3:  # a layer's own arrays: rows and kv heads on one axis
        k, v = (x.reshape(b * kv, t, h) for x in (k, v))
    slots = jnp.arange(cache.k.shape[-2])
    if cache.in_place:
        keys, values = (jax.lax.dynamic_update_slice_in_dim(c, x, cache.slot, axis=c.ndim - 2)
                        for c, x in ((cache.k, k), (cache.v, v)))
        sources, written = [(keys, values, slots, cache.valid, True)], (keys, values)
    else:  # the slice's slots of this step are not written yet: its own keys stand beside it
        own_valid = jax.lax.dynamic_slice_in_dim(cache.valid, cache.slot, t, axis=1)
        sources = [(cache.k, cache.v, slots, cache.valid & (slots < cache.slot)[None], False),
                   (k, v, cache.slot + jnp.arange(t), own_valid, True)]
        written = (k, v)
    qg = jnp.transpose(q.reshape(b, t, kv, g, h), (0, 2, 3, 1, 4))  # [B, K, G, T, H]
    qg = qg * (h ** -0.5 if scale is None else scale)
    outs = []
    for start in range(0, t, block):
        rows = qg[:, :, :, start:start + block]
        q_slot = cache.slot + jnp.arange(start, start + rows.shape[3])
        outs.append(_attend(rows, q_slot, sources, window))
    out = jnp.concatenate(outs, axis=3) if len(outs) > 1 else outs[0]     # [B, K, G, T, H]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).astype(q.dtype).reshape(b, t, n, h), written


def _attend(rows, q_slot, sources, window):
    """[B, K, G, Tb, H] f32: `rows [B, K, G, Tb, H]` (the queries at slots `q_slot [Tb]`)
    attending over every source `(keys, values [B, K, S_i, H] or [B K, S_i, H], their slots
    [S_i], valid [B, S_i], whether a query sees its own slot there)`, one softmax over them
    all. The G heads and Tb queries of a kv head are the rows of one product per source,
    batched over the sources' leading axes."""
    b, kv, g, tb, h = rows.shape
    merged = sources[0][0].ndim == 3
    lead = (b * kv,) if merged else (b, kv)
    flat = rows.reshape(*lead, g * tb, h)
    batch = "b" if merged else "bk"
    scores, seen = [], []
    for keys, _, slots, valid, itself in sources:
        near = (slots[None] <= q_slot[:, None]) & ((slots[None] > q_slot[:, None] - window) if window else True)
        mask = near[None] & valid[:, None, :]                                # [B, Tb, S_i]
        seen.append(mask | (slots[None] == q_slot[:, None])[None] if itself else mask)
        scores.append(jnp.einsum(f"{batch}qh,{batch}sh->{batch}qs", flat, keys.astype(rows.dtype),
                                 preferred_element_type=jnp.float32).reshape(b, kv, g, tb, -1))
    scores, seen = jnp.concatenate(scores, axis=-1), jnp.concatenate(seen, axis=-1)
    p = jax.nn.softmax(jnp.where(seen[:, None, None], scores, -jnp.inf), axis=-1)
    p = p.reshape(*lead, g * tb, -1)
    out, at = 0.0, 0
    for _, values, slots, _, _ in sources:
        part = p[..., at:at + slots.shape[0]].astype(values.dtype)
        out = out + jnp.einsum(f"{batch}qs,{batch}sh->{batch}qh", part, values,
                               preferred_element_type=jnp.float32)
        at += slots.shape[0]
    return out.reshape(b, kv, g, tb, h)

"""One pre-norm decoder layer, the unit the decoder stacks, scans or runs on its own."""
from __future__ import annotations

from typing import NamedTuple

import jax
from flax import nnx

from cmoe_jax.models.config import ModelConfig
from cmoe_jax.models.ffn import make_ffn
from cmoe_jax.models.layers import Attention, RMSNorm, SwiGLU


class LayerOutput(NamedTuple):
    """What a decoder layer returns; read it by name (`out.h`, `out.load`)."""

    h: jax.Array  # the residual stream after the layer
    ffn_input: jax.Array  # what its FFN saw (the post-attention RMSNorm)
    load: jax.Array | None  # tokens per routed expert, int32 [E]; None for a dense FFN
    kv: tuple | None = None  # with a cache: the step's new (keys, values); else None


class DecoderLayer(nnx.Module):
    """Pre-norm layer; with `sandwich_norms` (Gemma) the attention and FFN outputs are
    normed too before their residual adds (`attn_out_norm`, `ffn_out_norm`). `rope` is the
    decoder's tuple of RoPE tables, (global,) or (global, local); the layer picks its own."""

    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, offset=cfg.norm_offset)
        self.input_norm = norm()
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs, window=cfg.window(layer))
        self.post_attn_norm = norm()
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.attn_out_norm, self.ffn_out_norm = norm(), norm()
        self.rope_index = int(cfg.local_rope(layer))
        self.mlp = make_ffn(cfg, cfg.ffn_spec(layer), dtype=dtype, rngs=rngs)

    @jax.named_scope("attention")
    def _attend(self, h, rope, key=None, segments=None, cache=None):
        out = self.attn(self.input_norm(h), *rope[self.rope_index], key=key, segments=segments,
                        cache=cache)
        a, kv = out if cache is not None else (out, None)
        return h + (self.attn_out_norm(a) if self.sandwich else a), kv

    def attention_block(self, h: jax.Array, rope, key=None, segments=None) -> jax.Array:
        """Residual stream after attention (before the FFN)."""
        return self._attend(h, rope, key, segments)[0]

    def ffn_input(self, h: jax.Array) -> jax.Array:
        """What the FFN sees: the RMSNorm of the residual stream after attention."""
        return self.post_attn_norm(h)

    def __call__(self, h: jax.Array, rope, key=None, segments=None, cache=None) -> LayerOutput:
        """The layer's `LayerOutput`: new residual stream, FFN input, expert loads, and with
        `cache` the step's new keys and values.

        `key` drives the LoRA adapters' dropout (None: none); `segments`: prefix-shared
        packing, see `causal_attention`; `cache`: a `LayerCache` (incremental decoding)."""
        h, kv = self._attend(h, rope, key, segments, cache)
        with jax.named_scope("ffn"):
            x = self.ffn_input(h)
            if isinstance(self.mlp, SwiGLU):
                y, load = self.mlp(x, key), None
            else:
                y, load = self.mlp(x, return_load=True, key=key)
            return LayerOutput(self.ffn_residual(h, y), x, load, kv)

    def ffn_residual(self, h: jax.Array, y: jax.Array) -> jax.Array:
        """The residual stream after the FFN: h + y, or h + RMSNorm(y) with sandwich norms."""
        return h + (self.ffn_out_norm(y) if self.sandwich else y)

    def ffn_out(self) -> nnx.Module | None:
        """The norm applied to the FFN's output before its residual add (None: no norm), so
        that a pass holding only this and an FFN adds the FFN's output as the layer does."""
        return self.ffn_out_norm if self.sandwich else None

"""Building blocks of the decoders: RMSNorm, rotary embeddings, GQA attention, the GLU FFN.

Weights are stored in JAX layout (in_features, out_features) so a projection is `x @ w`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cmoe_jax.lora_variables import project
from cmoe_jax.models.config import ModelConfig, rope_inv_freq
from cmoe_jax.models.kv_cache import cached_attention
from cmoe_jax.moe.activations import glu_activation
from cmoe_jax.moe.params import with_axes

_init = nnx.initializers.normal(0.02)


def _param(rngs: nnx.Rngs, shape, dtype, axes: tuple) -> nnx.Param:
    """A weight drawn like the checkpoints were made, carrying its logical `axes`."""
    return nnx.Param(_init(rngs.params(), shape, dtype), **with_axes(axes))


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32 and cast back, as `transformers` does. With `offset`
    (Gemma: 1) the weight is stored as the checkpoint holds it and applied as `offset + w`,
    in float32 before the cast, as Gemma's norm does."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32, offset: float = 0.0):
        self.weight = nnx.Param(jnp.full((dim,), 1.0 - offset, dtype), **with_axes(("norm",)))
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (x32 * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * x32.astype(x.dtype)


def rope_tables(cfg: ModelConfig, positions: jax.Array, local: bool = False
                ) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [..., T, head_dim] for the given integer positions (`local`: the
    sliding layers' own RoPE base)."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg, local))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on x [B, T, N, H] with tables [T, H] or [B, T, H]."""
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class Attention(nnx.Module):
    """Causal grouped-query attention with optional q/k/v biases (Qwen2) and q/k RMSNorm (Qwen3)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, window: int = 0):
        """`window`: tokens a query sees, itself included (0: every earlier one)."""
        d, n, kv, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = n, kv, h
        self.window, self.scale = window, cfg.query_scale or h ** -0.5
        self.q_proj = _param(rngs, (d, n * h), dtype, ("embed", "heads"))
        self.k_proj = _param(rngs, (d, kv * h), dtype, ("embed", "kv_heads"))
        self.v_proj = _param(rngs, (d, kv * h), dtype, ("embed", "kv_heads"))
        self.o_proj = _param(rngs, (n * h, d), dtype, ("heads", "embed"))
        self.use_bias = cfg.attention_bias
        if self.use_bias:
            self.q_bias = nnx.Param(jnp.zeros((n * h,), dtype), **with_axes(("heads",)))
            self.k_bias = nnx.Param(jnp.zeros((kv * h,), dtype), **with_axes(("kv_heads",)))
            self.v_bias = nnx.Param(jnp.zeros((kv * h,), dtype), **with_axes(("kv_heads",)))
        self.use_qk_norm = cfg.qk_norm
        if self.use_qk_norm:
            self.qk_norm_all = cfg.qk_norm_scope == "all"  # OLMoE: over the whole projection
            q_dim, k_dim = (n * h, kv * h) if self.qk_norm_all else (h, h)
            self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps, dtype=dtype, offset=cfg.norm_offset)
            self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps, dtype=dtype, offset=cfg.norm_offset)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, key=None,
                 segments: jax.Array | None = None, cache=None):
        """Self-attention of x [B, T, d]; q/k/v/o add their LoRA adapters when they have
        some (`key`: the adapters' dropout key, None for no dropout). `segments`: see
        `causal_attention`. With `cache` (a `cmoe_jax.models.kv_cache.LayerCache`) the
        tokens attend over the cached ones too, and the result is (output, new (k, v))."""
        b, t, _ = x.shape
        q = project(self, "q_proj", x, self.q_proj[...], key)
        k = project(self, "k_proj", x, self.k_proj[...], key)
        v = project(self, "v_proj", x, self.v_proj[...], key)
        if self.use_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.use_qk_norm and self.qk_norm_all:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(b, t, self.num_heads, self.head_dim)
        k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
        v = v.reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm and not self.qk_norm_all:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            out, new_kv = cached_attention(q, k, v, cache, scale=self.scale, window=self.window)
            out = out.reshape(b, t, self.num_heads * self.head_dim)
            return project(self, "o_proj", out, self.o_proj[...], key), new_kv
        out = causal_attention(q, k, v, segments=segments, scale=self.scale,
                               window=self.window).reshape(b, t, self.num_heads * self.head_dim)
        return project(self, "o_proj", out, self.o_proj[...], key)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int = 128,
                     segments: jax.Array | None = None, scale: float | None = None,
                     window: int = 0) -> jax.Array:
    """Causal GQA attention, q [B, T, N, H], k/v [B, T, K, H] -> [B, T, N, H].

    `scale` multiplies the scores (None: H ** -0.5); `window` > 0 lets a query see only the
    `window` latest keys, itself included (sliding-window layers: key k visible from query
    q when q - window < k <= q, as `transformers` masks them).

    `segments` (int [B, T], optional) packs several sequences that share a prefix into one
    row: segment 0 is the shared prefix, and a token of segment s > 0 sees the earlier
    tokens of segment 0 and of its own segment only (so each continuation of a
    multiple-choice question reads the question once, `cmoe_jax.eval.loglikelihood`).

    Queries are processed in blocks that only see the keys up to their own end, which skips
    the masked upper triangle and keeps score tiles cache-sized. Written for XLA:CPU, where
    it is about 5x faster than `jax.nn.dot_product_attention` at T=2048:
    - the causal mask is a constant additive bias (an iota-compare `where` fuses poorly);
    - the softmax denominator comes out of the P @ V matmul through a column of ones
      appended to V, instead of a second reduction that would recompute exp(scores);
    - normalisation is applied to the [T, H] output, not the [T, S] probabilities.
    Scores and softmax run in float32 whatever the input dtype.
    """
    b, t, n, h = q.shape
    kv = k.shape[2]
    scale = h ** -0.5 if scale is None else scale
    qg = jnp.transpose(q.reshape(b, t, kv, n // kv, h), (0, 2, 3, 1, 4)) * scale
    kt, vt = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))
    vt1 = jnp.concatenate([vt, jnp.ones(vt.shape[:-1] + (1,), vt.dtype)], axis=-1)
    outs = []
    for start in range(0, t, block):
        end = min(t, start + block)
        scores = jnp.einsum("bkgth,bksh->bkgts", qg[:, :, :, start:end], kt[:, :, :end],
                            preferred_element_type=jnp.float32)
        delta = np.arange(start, end)[:, None] - np.arange(end)[None, :]
        visible = (delta >= 0) & ((delta < window) if window else True)
        scores = scores + np.where(visible, 0.0, -np.inf).astype(np.float32)
        if segments is not None:
            sq, sk = segments[:, start:end, None], segments[:, None, :end]
            same = (sk == 0) | (sk == sq)  # [B, tq, s], broadcast over kv heads and groups
            scores = jnp.where(same[:, None, None], scores, -jnp.inf)
        p = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
        o = jnp.einsum("bkgts,bksh->bkgth", p.astype(v.dtype), vt1[:, :, :end],
                       preferred_element_type=jnp.float32)
        outs.append((o[..., :h] / o[..., h:]).astype(v.dtype))
    out = jnp.concatenate(outs, axis=3)
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, n, h)


class SwiGLU(nnx.Module):
    """Dense GLU FFN: down(act(x @ gate) * (x @ up)); act is SiLU (SwiGLU) unless the
    family says otherwise (`activation`, a `cmoe_jax.moe.activations` name)."""

    def __init__(self, d_model: int, width: int, *, dtype, rngs: nnx.Rngs,
                 activation: str):
        self.gate = _param(rngs, (d_model, width), dtype, ("embed", "mlp"))
        self.up = _param(rngs, (d_model, width), dtype, ("embed", "mlp"))
        self.down = _param(rngs, (width, d_model), dtype, ("mlp", "embed"))
        self.activation = activation

    def hidden(self, x: jax.Array, key=None) -> jax.Array:
        """The FFN hidden activations h = act(x W_gate) * (x W_up) that CMoE profiles."""
        act = glu_activation(self.activation)
        return (act(project(self, "gate", x, self.gate[...], key))
                * project(self, "up", x, self.up[...], key))

    def __call__(self, x: jax.Array, key=None) -> jax.Array:
        return project(self, "down", self.hidden(x, key), self.down[...], key)

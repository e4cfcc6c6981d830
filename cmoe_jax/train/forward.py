"""The decoder forward pass with LoRA adapters, trainable router scales u and explicit biases b.

Mirrors `Decoder.__call__` / `MoEFFN.__call__` op for op, adding `scale * drop(x) @ A @ B`
to every adapted projection (so zero adapters give bit-identical outputs). Routed experts
get their low-rank deltas through the grouped-matmul dispatch: the sorted rows go through
`gmm(rows, A)` then `gmm(., B)` with the same group sizes as the base weights. The loss is
the mean next-token NLL with the LM head applied in rematerialised chunks, so the
`[B, T, vocab]` logits are never stored.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cmoe_jax.models.layers import SwiGLU, apply_rope, causal_attention
from cmoe_jax.moe.dispatch import routed_experts
from cmoe_jax.moe.gmm import get_gmm
from cmoe_jax.moe.routers import cmoe_route


class Dropout:
    """LoRA input dropout; one fresh mask per adapter call, derived from `key` by call order."""

    def __init__(self, rate: float, key: jax.Array | None):
        self.rate, self.key, self.calls = rate, key, 0

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.rate == 0.0 or self.key is None:
            return x
        self.calls += 1
        keep = jax.random.bernoulli(jax.random.fold_in(self.key, self.calls), 1.0 - self.rate, x.shape)
        return jnp.where(keep, x / (1.0 - self.rate), jnp.zeros((), x.dtype))


def _proj(x, w, adapter, scale, drop):
    y = x @ w
    if adapter is None:
        return y
    low = (drop(x).astype(jnp.float32) @ adapter["a"]) @ adapter["b"]
    return y + (scale * low).astype(y.dtype)


def _attention(attn, x, cos, sin, ad, scale, drop):
    b, t, _ = x.shape
    q = _proj(x, attn.q_proj[...], ad.get("q_proj"), scale, drop)
    k = _proj(x, attn.k_proj[...], ad.get("k_proj"), scale, drop)
    v = _proj(x, attn.v_proj[...], ad.get("v_proj"), scale, drop)
    if attn.use_bias:
        q, k, v = q + attn.q_bias[...], k + attn.k_bias[...], v + attn.v_bias[...]
    q = q.reshape(b, t, attn.num_heads, attn.head_dim)
    k = k.reshape(b, t, attn.num_kv_heads, attn.head_dim)
    v = v.reshape(b, t, attn.num_kv_heads, attn.head_dim)
    if attn.use_qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = causal_attention(q, k, v).reshape(b, t, attn.num_heads * attn.head_dim)
    return _proj(out, attn.o_proj[...], ad.get("o_proj"), scale, drop)


def _swiglu(x, gate, up, down, ad, names, scale, drop):
    g = _proj(x, gate, ad.get(names[0]), scale, drop)
    u = _proj(x, up, ad.get(names[1]), scale, drop)
    return _proj(jax.nn.silu(g) * u, down, ad.get(names[2]), scale, drop)


def _moe(mlp, x, ad, u, bias, scale, drop):
    shape = x.shape
    x = x.reshape(-1, mlp.d_model).astype(mlp.dtype)
    if mlp.router == "cmoe":
        ids, gates = cmoe_route(x, mlp.router_gate[...], mlp.router_up[...], u, bias, mlp.top_k)
    else:
        ids, gates = mlp.route(x)
    c = lambda p: p[...].astype(mlp.dtype)
    if mlp.shared_width:
        shared = _swiglu(x, c(mlp.shared_gate), c(mlp.shared_up), c(mlp.shared_down), ad,
                         ("shared_gate", "shared_up", "shared_down"), scale, drop)
    else:
        shared = jnp.zeros_like(x)
    gmm = get_gmm(mlp.backend)

    def lora(name, rows, sizes):
        adapter = ad.get("expert_" + name)
        if adapter is None:
            return None
        low = gmm(gmm(drop(rows).astype(jnp.float32), adapter["a"], sizes), adapter["b"], sizes)
        return scale * low

    routed, counts = routed_experts(x, ids, gates, c(mlp.expert_gate), c(mlp.expert_up),
                                    c(mlp.expert_down), gmm, lora=lora if ad else None)
    y = (shared.astype(jnp.float32) + routed).astype(mlp.dtype).reshape(shape)
    return y, counts


def lora_hidden(model, adapters: dict, u: dict, bias: dict, tokens: jax.Array, *,
                scale: float, dropout: float = 0.0, key: jax.Array | None = None,
                remat: bool = False):
    """Residual stream after the last layer, and the expert loads `{layer: int32 [E]}` of
    every CMoE layer. `u` / `bias` map layer index strings to that layer's router scales and
    selection bias (layers missing from them use the model's own)."""
    drop = Dropout(dropout, key)
    layers = adapters.get("layers", {})
    cos, sin = model.rope(tokens.shape[-1])
    h = model.embed_tokens(tokens)
    loads = {}
    for i, layer in enumerate(model.layers):
        ad = layers.get(str(i), {})

        def block(h, ad, u_i, b_i, layer=layer):
            attn_ad, mlp_ad = ad.get("attn", {}), ad.get("mlp", {})
            h = h + _attention(layer.attn, layer.input_norm(h), cos, sin, attn_ad, scale, drop)
            x = layer.ffn_input(h)
            mlp = layer.mlp
            if isinstance(mlp, SwiGLU):
                y = _swiglu(x, mlp.gate[...], mlp.up[...], mlp.down[...], mlp_ad,
                            ("gate", "up", "down"), scale, drop)
                return h + y, None
            y, counts = _moe(mlp, x, mlp_ad, u_i, b_i, scale, drop)
            return h + y, counts

        mlp = layer.mlp
        u_i = b_i = None
        if getattr(mlp, "router", None) == "cmoe":
            u_i = u.get(str(i), mlp.u[...])
            b_i = jax.lax.stop_gradient(bias.get(str(i), mlp.router_bias[...]))
        fn = jax.checkpoint(block) if remat else block
        h, counts = fn(h, ad, u_i, b_i)
        if u_i is not None:
            loads[str(i)] = counts
    return h, loads


def lora_logits(model, adapters: dict, u: dict | None = None, bias: dict | None = None,
                tokens=None, *, scale: float, dropout: float = 0.0, key=None) -> jax.Array:
    """Logits `[B, T, vocab]` of the adapted model (for tests and small inputs)."""
    h, _ = lora_hidden(model, adapters, u or {}, bias or {}, tokens, scale=scale,
                       dropout=dropout, key=key)
    return model.unembed(h)


def next_token_nll(model, h: jax.Array, tokens: jax.Array, chunk: int = 128) -> jax.Array:
    """Mean NLL of tokens[:, 1:] from hidden states h; LM head in rematerialised chunks."""
    h = model.norm(h)[:, :-1]
    labels = tokens[:, 1:]
    b, t, d = h.shape
    chunk = min(chunk, t)
    pad = (-t) % chunk
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    labels = jnp.pad(labels, ((0, 0), (0, pad)))
    n = (t + pad) // chunk
    hc = h.reshape(b, n, chunk, d).transpose(1, 0, 2, 3)
    lc = labels.reshape(b, n, chunk).transpose(1, 0, 2)
    head = model.embed[...].T if model.config.tie_word_embeddings else model.lm_head[...]

    @jax.checkpoint
    def one(args):
        hx, lx = args
        logits = (hx @ head).astype(jnp.float32)
        gold = jnp.take_along_axis(logits, lx[..., None], axis=-1)[..., 0]
        return jax.nn.logsumexp(logits, axis=-1) - gold

    nll = jax.lax.map(one, (hc, lc)).transpose(1, 0, 2).reshape(b, n * chunk)[:, :t]
    return jnp.mean(nll)


def lora_loss(model, adapters, u, bias, tokens, *, scale, dropout=0.0, key=None, remat=False):
    """(mean next-token NLL, expert loads by layer) of the adapted model on `tokens [B, T]`."""
    h, loads = lora_hidden(model, adapters, u, bias, tokens, scale=scale, dropout=dropout,
                           key=key, remat=remat)
    return next_token_nll(model, h, tokens), loads

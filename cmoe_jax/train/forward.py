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
from flax import nnx

from cmoe_jax.models.decoder import chunked_nll
from cmoe_jax.models.layers import SwiGLU
from cmoe_jax.moe.expert_parallel import routed_swiglu_experts
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
    return attn(x, cos, sin, project=lambda name, inp, w: _proj(inp, w, ad.get(name), scale, drop))


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

    def make_lora(expert_ad):  # expert_ad: this device's experts' adapters when expert-parallel
        def lora(name, rows, sizes):
            adapter = expert_ad.get("expert_" + name)
            if adapter is None:
                return None
            low = gmm(gmm(drop(rows).astype(jnp.float32), adapter["a"], sizes), adapter["b"], sizes)
            return scale * low
        return lora

    weights = (c(mlp.expert_gate), c(mlp.expert_up), c(mlp.expert_down))
    expert_ad = {k: v for k, v in ad.items() if k.startswith("expert_")}
    routed, counts = routed_swiglu_experts(x, ids, gates, weights, gmm, expert_axis=mlp.expert_axis,
                                           adapters=expert_ad, make_lora=make_lora)
    y = (shared.astype(jnp.float32) + routed).astype(mlp.dtype).reshape(shape)
    return y, counts


def _block(layer, h, cos, sin, ad, u_i, b_i, scale, drop):
    """One decoder layer with adapters: (new residual stream, expert loads or None)."""
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


def _uniform(model, adapters: dict) -> bool:
    """All layers share one structure (graph, shapes, adapters): they can run as one scan."""
    first = nnx.split(model.layers[0])
    shapes = lambda st: jax.tree.map(lambda a: (a.shape, a.dtype), st)
    ref_ad = jax.tree.map(lambda a: a.shape, adapters.get("0", {}))
    for i, layer in enumerate(model.layers):
        gd, st = nnx.split(layer)
        if gd != first[0] or shapes(st) != shapes(first[1]):
            return False
        if jax.tree.map(lambda a: a.shape, adapters.get(str(i), {})) != ref_ad:
            return False
    return True


def lora_hidden(model, adapters: dict, u: dict, bias: dict, tokens: jax.Array, *,
                scale: float, dropout: float = 0.0, key: jax.Array | None = None,
                remat: bool = False, scan: bool = True):
    """Residual stream after the last layer, and the expert loads `{layer: int32 [E]}` of
    every CMoE layer. `u` / `bias` map layer index strings to that layer's router scales and
    selection bias (layers missing from them use the model's own).

    When every layer has the same structure (dense models, uniformly converted ones) and
    `scan` is set, the layers run as one `jax.lax.scan` over their stacked weights, which
    compiles once instead of once per layer; otherwise as a Python loop. Both give the same
    result; layer i's dropout masks come from `fold_in(key, i)` either way.
    """
    layers_ad = adapters.get("layers", {})
    cos, sin = model.rope(tokens.shape[-1])
    h = model.embed_tokens(tokens)
    n = len(model.layers)

    def router_inputs(i, mlp):
        if getattr(mlp, "router", None) != "cmoe":
            return None, None
        return (u.get(str(i), mlp.u[...]).astype(jnp.float32),
                jax.lax.stop_gradient(bias.get(str(i), mlp.router_bias[...]).astype(jnp.float32)))

    def drop_for(i):
        return Dropout(dropout, None if key is None else jax.random.fold_in(key, i))

    cmoe = [getattr(layer.mlp, "router", None) == "cmoe" for layer in model.layers]

    def keeps_dtype():  # a scan carry must keep its dtype (a float32 MoE in a bf16 model does not)
        u0, b0 = router_inputs(0, model.layers[0].mlp)
        out = jax.eval_shape(lambda h: _block(model.layers[0], h, cos, sin, layers_ad.get("0", {}),
                                              u0, b0, scale, Dropout(0.0, None))[0], h)
        return out.dtype == h.dtype

    if scan and n > 1 and _uniform(model, layers_ad) and keeps_dtype():
        graphdef = nnx.split(model.layers[0])[0]
        stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
        weights = stack([nnx.state(layer) for layer in model.layers])
        ads = stack([layers_ad.get(str(i), {}) for i in range(n)])
        ub = [router_inputs(i, layer.mlp) for i, layer in enumerate(model.layers)]
        us = stack([x[0] for x in ub]) if cmoe[0] else None
        bs = stack([x[1] for x in ub]) if cmoe[0] else None

        def body(h, xs):
            i, st, ad, u_i, b_i = xs
            return _block(nnx.merge(graphdef, st), h, cos, sin, ad, u_i, b_i, scale, drop_for(i))

        h, counts = jax.lax.scan(jax.checkpoint(body) if remat else body, h,
                                 (jnp.arange(n), weights, ads, us, bs))
        loads = {str(i): counts[i] for i in range(n)} if cmoe[0] else {}
        return h, loads
    loads = {}
    for i, layer in enumerate(model.layers):
        u_i, b_i = router_inputs(i, layer.mlp)
        fn = lambda h, ad, u_i, b_i, i=i, layer=layer: _block(layer, h, cos, sin, ad, u_i, b_i,
                                                               scale, drop_for(i))
        h, counts = (jax.checkpoint(fn) if remat else fn)(h, layers_ad.get(str(i), {}), u_i, b_i)
        if cmoe[i]:
            loads[str(i)] = counts
    return h, loads


def lora_logits(model, adapters: dict, u: dict | None = None, bias: dict | None = None,
                tokens=None, *, scale: float, dropout: float = 0.0, key=None,
                scan: bool = True) -> jax.Array:
    """Logits `[B, T, vocab]` of the adapted model (for tests and small inputs)."""
    h, _ = lora_hidden(model, adapters, u or {}, bias or {}, tokens, scale=scale,
                       dropout=dropout, key=key, scan=scan)
    return model.unembed(h)


def next_token_nll(model, h: jax.Array, tokens: jax.Array, chunk: int = 128) -> jax.Array:
    """Mean NLL of tokens[:, 1:] from hidden states h; LM head in rematerialised chunks."""
    h = model.norm(h)[:, :-1]
    return jnp.mean(chunked_nll(h, tokens[:, 1:], model.lm_head_matrix(), chunk, remat=True))


def lora_loss(model, adapters, u, bias, tokens, *, scale, dropout=0.0, key=None, remat=False,
              scan=True):
    """(mean next-token NLL, expert loads by layer) of the adapted model on `tokens [B, T]`."""
    h, loads = lora_hidden(model, adapters, u, bias, tokens, scale=scale, dropout=dropout,
                           key=key, remat=remat, scan=scan)
    return next_token_nll(model, h, tokens), loads

"""Per-token negative log-likelihood from hidden states, without whole-sequence logits."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def chunked_nll(h: jax.Array, labels: jax.Array, head: jax.Array, chunk: int = 128,
                remat: bool = False) -> jax.Array:
    """Per-position NLL [B, T] of `labels` under logits `h @ head`, over chunks of positions.

    Only one [B, chunk, vocab] logits tile lives at a time; `remat=True` recomputes it in the
    backward pass too (training), instead of keeping every tile for the gradient.
    """
    b, t, d = h.shape
    chunk = min(chunk, t)
    pad = (-t) % chunk
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    labels = jnp.pad(labels, ((0, 0), (0, pad)))
    n = (t + pad) // chunk
    hc = h.reshape(b, n, chunk, d).transpose(1, 0, 2, 3)
    lc = labels.reshape(b, n, chunk).transpose(1, 0, 2)

    def one(args):
        hx, lx = args
        logits = (hx @ head).astype(jnp.float32)
        gold = jnp.take_along_axis(logits, lx[..., None], axis=-1)[..., 0]
        return jax.nn.logsumexp(logits, axis=-1) - gold

    nll = jax.lax.map(jax.checkpoint(one) if remat else one, (hc, lc))  # [n, b, chunk]
    return nll.transpose(1, 0, 2).reshape(b, n * chunk)[:, :t]

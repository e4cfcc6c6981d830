"""Perplexity over non-overlapping windows, data-parallel over all local devices.

Each window of T tokens predicts its last T-1 tokens; perplexity is exp of the mean token
negative log-likelihood over all windows (the GPTQ evaluation convention).
"""
from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm


@functools.partial(jax.jit, static_argnums=0)
def _window_nll(graphdef, state, tokens):
    """Summed NLL per window [B] (float32); the logits never leave the device."""
    return nnx.merge(graphdef, state).token_nll(tokens).sum(axis=-1)


def perplexity(model, windows: np.ndarray, *, batch_size: int | None = None, devices=None,
               progress: bool = True) -> dict:
    """ppl, mean nll, windows, tokens, tokens/s and seconds for `model` on `windows` [N, T]."""
    windows = np.asarray(windows, np.int32)
    n, t = windows.shape
    devices = list(jax.local_devices() if devices is None else devices)
    mesh = Mesh(np.array(devices), ("data",))
    per_step = batch_size or len(devices)
    per_step = int(math.ceil(per_step / len(devices)) * len(devices))  # a multiple of devices
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, NamedSharding(mesh, P()))
    batch_sharding = NamedSharding(mesh, P("data"))
    total, counted, seconds = 0.0, 0, 0.0
    bar = tqdm(total=n * (t - 1), unit="tok", unit_scale=True, desc="perplexity", disable=not progress)
    for start in range(0, n, per_step):
        batch = windows[start:start + per_step]
        real = len(batch)
        if real < per_step:  # pad with copies of the first window; masked out of the sums
            batch = np.concatenate([batch, np.repeat(batch[:1], per_step - real, axis=0)])
        t0 = time.perf_counter()
        nll = np.asarray(_window_nll(graphdef, state, jax.device_put(batch, batch_sharding)),
                         dtype=np.float64)
        if start > 0 or n <= per_step:  # leave the compilation out of tokens/s when possible
            seconds += time.perf_counter() - t0
            counted += real * (t - 1)
        total += nll[:real].sum()
        bar.update(real * (t - 1))
        if seconds > 0:
            bar.set_postfix(tok_s=f"{counted / seconds:,.0f}", ppl=f"{math.exp(total / ((start + real) * (t - 1))):.3f}")
    bar.close()
    tokens = n * (t - 1)
    mean = total / tokens
    return {"ppl": math.exp(mean), "nll": mean, "windows": n, "tokens": tokens,
            "tokens_per_s": counted / seconds if seconds > 0 else float("nan"),
            "seconds": seconds, "devices": len(devices)}

"""Greedy generation for lm-eval's `generate_until`: batched, bucketed, no KV cache.

Each step re-reads the whole (right-padded) sequence and takes the argmax at every row's last
real position; the sequence length is padded to the rungs of `length_bucket`, so a whole
generation compiles a handful of shapes. Without a KV cache a step costs a full forward, which
is fine for the short answers of zero-shot tasks and keeps the model's plain forward.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from cmoe_jax.errors import InputError
from cmoe_jax.eval.loglikelihood import length_bucket
from cmoe_jax.sharding import make_mesh, placed_split


@functools.partial(jax.jit, static_argnums=0)
def _next_tokens(graphdef, state, tokens, last):
    """Argmax token [B] after position `last` [B] of each row of `tokens` [B, T]."""
    model = nnx.merge(graphdef, state)
    if hasattr(model, "hidden_states") and hasattr(model, "unembed"):
        h = jnp.take_along_axis(model.hidden_states(tokens), last[:, None, None], axis=1)
        logits = model.unembed(h)[:, 0]
    else:
        logits = jnp.take_along_axis(model(tokens), last[:, None, None], axis=1)[:, 0]
    return jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)


def greedy_generate(model, prompts, max_new_tokens: int, stop: Callable[[list[int]], bool],
                    batch_size: int = 8, mesh: Mesh | None = None, max_length: int | None = None,
                    progress: bool = True) -> list[list[int]]:
    """Greedy continuations (token ids) of each prompt; a row ends when `stop(generated)` is
    true or after `max_new_tokens`. Prompts are cut from the left to leave room for them."""
    mesh = make_mesh() if mesh is None else mesh
    n_data = dict(mesh.shape)["data"]
    rows = -(-max(1, batch_size) // n_data) * n_data
    cfg = getattr(model, "config", None)
    max_length = max_length or getattr(cfg, "max_position_embeddings", None) or 2048
    keep = max(1, max_length - max_new_tokens)
    prompts = [list(p)[-keep:] for p in prompts]
    if any(not p for p in prompts):
        raise InputError("every prompt needs at least one token")
    graphdef, state = placed_split(model, mesh)
    sharding = NamedSharding(mesh, P("data"))
    outputs: list[list[int]] = [[] for _ in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    bar = tqdm(total=len(prompts), unit="req", desc="generate", disable=not progress)
    for start in range(0, len(order), rows):
        active = order[start:start + rows]
        while active:
            seqs = [prompts[i] + outputs[i] for i in active]
            length = length_bucket(max(map(len, seqs)), max_length)
            tokens = np.zeros((rows, length), np.int32)
            last = np.zeros((rows,), np.int32)
            for r, seq in enumerate(seqs):
                tokens[r, :len(seq)] = seq
                last[r] = len(seq) - 1
            nxt = np.asarray(_next_tokens(graphdef, state, *jax.device_put((tokens, last), sharding)))
            still = []
            for r, i in enumerate(active):
                outputs[i].append(int(nxt[r]))
                full = len(prompts[i]) + len(outputs[i]) >= max_length
                if stop(outputs[i]) or len(outputs[i]) >= max_new_tokens or full:
                    bar.update(1)
                else:
                    still.append(i)
            active = still
    bar.close()
    return outputs

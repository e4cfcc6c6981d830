"""Perplexity over non-overlapping windows, data-parallel over all devices.

Each window of T tokens predicts its last T-1 tokens (labels tokens[1:], logits[:-1]);
perplexity is exp of the mean token negative log-likelihood over all windows (the GPTQ
evaluation convention).

Data parallelism: a `Mesh` with a "data" axis (by default over this process's devices); the
parameters are replicated (or kept sharded over a "model" axis when the mesh has one), each
step's batch of windows is sharded over "data" and holds a multiple of that axis' size;
the last batch is padded with dummy windows whose NLL is dropped. One jit-compiled step
returns the summed NLL of every window (log-softmax in float32 on device; the logits never
reach the host); the per-window NLLs are summed on the host in float64, in window order. Over
several processes (`cmoe_jax.distributed`) each takes its share of the windows and the
per-window NLLs are gathered before that sum, so the result has the single-process bits.
"""
from __future__ import annotations

import collections
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from cmoe_jax import distributed
from cmoe_jax.data import DataError
from cmoe_jax.sharding import make_mesh, placed_split


def _summed_nll(model, tokens: jax.Array) -> jax.Array:
    """Summed NLL [B] (float32) of tokens[:, 1:] for each window."""
    if hasattr(model, "token_nll"):  # chunked LM head: never materialises [B, T, vocab]
        return model.token_nll(tokens).astype(jnp.float32).sum(axis=-1)
    logits = model(tokens)[:, :-1].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    gold = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return -gold.sum(axis=-1)


@functools.partial(jax.jit, static_argnums=0)
def _window_nll(graphdef, state, tokens):
    return _summed_nll(nnx.merge(graphdef, state), tokens)


_COMPILED: "collections.OrderedDict" = collections.OrderedDict()  # a few compiled steps, LRU
_COMPILED_MAX = 8


def _compiled_step(graphdef, state, batch_shape, batch_sharding):
    """The AOT-compiled step for this model structure, parameter layout and batch shape."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    key = (graphdef, treedef, tuple((x.shape, x.dtype, x.sharding) for x in leaves),
           batch_shape, batch_sharding)
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key]
    batch = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=batch_sharding)
    step = _window_nll.lower(graphdef, state, batch).compile()
    _COMPILED[key] = step
    if len(_COMPILED) > _COMPILED_MAX:
        _COMPILED.popitem(last=False)
    return step


def _check_windows(model, windows) -> np.ndarray:
    windows = np.asarray(windows)
    if windows.ndim != 2 or windows.shape[0] < 1 or windows.shape[1] < 2:
        raise DataError(f"windows must be an [N, T] array with N >= 1 and T >= 2, got shape {windows.shape}")
    if not np.issubdtype(windows.dtype, np.integer):
        raise DataError(f"windows must hold integer token ids, got dtype {windows.dtype}")
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    if vocab is not None and (windows.min() < 0 or windows.max() >= vocab):
        raise DataError(f"token ids must lie in [0, {vocab}) for this model, got "
                        f"[{windows.min()}, {windows.max()}]: was the text tokenized with its tokenizer?")
    context = getattr(cfg, "max_position_embeddings", None)
    if context is not None and windows.shape[1] > context:
        raise DataError(f"windows of {windows.shape[1]} tokens exceed the model's context of {context}")
    return windows.astype(np.int32, copy=False)


def _windows_per_step(batch_size: int | None, n: int, n_data: int) -> int:
    """Windows a step reads: `batch_size` (default one a device), no more than the `n` there
    are, rounded up to a multiple of the data-parallel size."""
    per_step = max(1, batch_size or n_data)
    per_step = min(per_step, n)  # no point in padding beyond the data
    return -(-per_step // n_data) * n_data


def _batches(windows: np.ndarray, per_step: int, sharding):
    """(real windows, the batch placed on the devices) for each step; the last batch is
    filled with dummy copies of the first window, dropped from the sums."""
    for start in range(0, len(windows), per_step):
        batch = windows[start:start + per_step]
        real = len(batch)
        if real < per_step:
            batch = np.concatenate([batch, np.repeat(windows[:1], per_step - real, axis=0)])
        yield real, jax.device_put(batch, sharding)


def _window_nlls(step, state, batches, bar, t: int) -> np.ndarray:
    """Summed NLL of each real window, in order; the next step is dispatched before the last
    one's output is read, and the bar shows the running perplexity."""
    total, done, per_window = 0.0, 0, []
    pending = collections.deque()

    def collect():
        nonlocal total, done
        real, out = pending.popleft()
        per_window.append(np.asarray(out)[:real])
        total += float(np.asarray(out, dtype=np.float64)[:real].sum())
        done += real
        bar.update(real * (t - 1))
        bar.set_postfix(ppl=f"{math.exp(total / (done * (t - 1))):.4f}", refresh=False)

    for real, batch in batches:
        pending.append((real, step(state, batch)))  # dispatch the next step before waiting
        if len(pending) > 1:
            collect()
    while pending:
        collect()
    return np.concatenate(per_window)


def perplexity(model, windows, batch_size: int | None = None, mesh: Mesh | None = None,
               progress: bool = True) -> dict:
    """Perplexity of `model` on int32 `windows` [N, T].

    model: an nnx.Module; `model(tokens [B, T]) -> logits [B, T, V]`, or with a
        `token_nll(tokens) -> [B, T-1]` method, which is used instead (no full logits).
    batch_size: windows per step, rounded up to a multiple of the mesh's "data" size and
        capped at what N needs (default: one window per device).
    mesh: a Mesh with a "data" axis (default: all devices on one "data" axis).

    Returns ppl, nll (mean per token), windows, tokens (N*(T-1)), tokens_per_s and seconds
    (evaluation only: every window, without compilation), compile_seconds (near 0 when this model
    structure and batch shape were compiled by an earlier call), devices (size of "data"),
    batch_size.
    """
    windows = _check_windows(model, windows)
    # several processes: each takes its contiguous share; the per-window NLLs are gathered
    windows = distributed.split_for_process(windows)
    n, t = windows.shape
    mesh = make_mesh() if mesh is None else mesh
    if "data" not in mesh.axis_names:
        raise ValueError(f"the mesh needs a 'data' axis, it has {mesh.axis_names}")
    n_data = dict(mesh.shape)["data"]
    per_step = _windows_per_step(batch_size, n, n_data)
    batch_sharding = NamedSharding(mesh, P("data"))
    graphdef, state = placed_split(model, mesh)
    t0 = time.perf_counter()
    step = _compiled_step(graphdef, state, (per_step, t), batch_sharding)
    compile_seconds = time.perf_counter() - t0
    bar = tqdm(total=n * (t - 1), unit="tok", unit_scale=True, desc="perplexity", disable=not progress)
    t0 = time.perf_counter()
    per_window = _window_nlls(step, state, _batches(windows, per_step, batch_sharding), bar, t)
    seconds = time.perf_counter() - t0
    bar.close()
    # summed in window order on every process: the same bits whatever the process count
    per_window = distributed.gather_rows(per_window)
    n = len(per_window)
    tokens = n * (t - 1)
    mean = float(per_window.astype(np.float64).sum()) / tokens
    return {"ppl": math.exp(mean), "nll": mean, "windows": n, "tokens": tokens,
            "tokens_per_s": tokens / seconds, "seconds": seconds,
            "compile_seconds": compile_seconds, "devices": n_data, "batch_size": per_step}

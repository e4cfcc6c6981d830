"""Log-likelihood of continuations given contexts (the zero-shot multiple-choice measure).

For each (context, continuation) pair of token lists: the summed log-probability of the
continuation's tokens and whether every one of them is the argmax (greedy) token, exactly as
lm-evaluation-harness computes them: the sequence is (context + continuation) cut from the
left to `max_length + 1` tokens, the model reads all but its last token, and the positions
that predict the continuation are scored.

Batching: requests are sorted by length and cut into batches of `batch_size` rows; each batch
is right-padded to the next length of a short geometric ladder, and its continuation slots to
the power of two that fits every continuation of that rung, so each rung is one compiled shape. Right padding needs no mask in
a causal model: padded tokens come after every scored position, and padded continuation slots
are masked out of the sums. Only the scored positions reach the LM head (in chunks of rows),
so no [B, T, vocab] logits exist. Rows are sharded over the mesh's "data" axis.
"""
from __future__ import annotations

import collections
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from cmoe_jax.eval import layer_scan
from cmoe_jax.sharding import make_mesh

_HEAD_ROWS = 256  # scored positions per LM-head tile


def encode_pair(encode, context: str, continuation: str, prefix_token: int | None = None):
    """(context_ids, continuation_ids) the way lm-eval's causal backends split them.

    Trailing whitespace of the context moves to the continuation; the whole string is encoded
    once and split at the length of the encoded context, so the continuation's tokens are
    those the model actually sees after the context. An empty context becomes
    `[prefix_token]` (lm-eval uses BOS, else EOS), unless the continuation starts with it.
    """
    if context == "":
        cont = list(encode(continuation))
        if prefix_token is None:
            raise ValueError("an empty context needs a prefix token (BOS or EOS) to condition on")
        return ([prefix_token], cont) if not cont or cont[0] != prefix_token else (cont[:1], cont[1:])
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = list(encode(context + continuation))
    n_context = len(encode(context))
    return whole[:n_context], whole[n_context:]


def length_bucket(n: int, limit: int) -> int:
    """Smallest rung >= n of the ladder 16, 24, 32, 40, 48, 64, 80, 96, 128, ... (capped at limit).

    Rungs grow by ~1.25x (rounded up to multiples of 8), so padding wastes at most ~25% while
    a whole ARC-sized task compiles half a dozen shapes.
    """
    rung = 16
    while rung < n:
        rung = -(-int(rung * 1.25) // 8) * 8
    return min(rung, max(limit, n))


def _pow2_at_least(n: int, floor: int = 4) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def _scored_rows(model, tokens, positions, labels, mask):
    """Summed log-prob [B] and all-greedy flag [B] of `labels` read at `positions` of each row."""
    b, c = positions.shape
    if hasattr(model, "hidden_states") and hasattr(model, "unembed"):
        h = model.hidden_states(tokens)
        picked = jnp.take_along_axis(h, positions[..., None], axis=1).reshape(b * c, -1)
        rows = picked.shape[0]
        tile = min(_HEAD_ROWS, rows)
        pad = (-rows) % tile
        picked = jnp.pad(picked, ((0, pad), (0, 0))).reshape(-1, tile, picked.shape[-1])
        logits = jax.lax.map(lambda x: model.unembed(x).astype(jnp.float32), picked)
        logits = logits.reshape(rows + pad, -1)[:rows].reshape(b, c, -1)
    else:  # any module returning logits [B, T, vocab]
        logits = jnp.take_along_axis(model(tokens), positions[..., None], axis=1).astype(jnp.float32)
    gold = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    logp = gold - jax.nn.logsumexp(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1) == labels
    return jnp.where(mask, logp, 0.0).sum(-1), jnp.all(greedy | ~mask, axis=-1)


@functools.partial(jax.jit, static_argnums=0)
def _score_step(graphdefs, states, tokens, positions, labels, mask):
    return _scored_rows(layer_scan.merge_parts(graphdefs, states), tokens, positions, labels, mask)


def _prepare(requests, max_length: int):
    """Per request: model input ids (truncated from the left) and its continuation ids."""
    prepared = []
    for i, (context, continuation) in enumerate(requests):
        context, continuation = list(context), list(continuation)
        if len(continuation) > max_length:
            raise ValueError(f"request {i}: continuation of {len(continuation)} tokens exceeds "
                             f"the model's context of {max_length}")
        seq = (context + continuation)[-(max_length + 1):]
        if len(seq) < 2 and continuation:
            raise ValueError(f"request {i}: needs at least one context token before the continuation")
        prepared.append((seq[:-1], continuation))
    return prepared


def _batch_arrays(items, rows: int, length: int, cont_len: int):
    """Right-padded int32 arrays for one batch; missing rows repeat the first item."""
    items = items + [items[0]] * (rows - len(items))
    tokens = np.zeros((rows, length), np.int32)
    positions = np.zeros((rows, cont_len), np.int32)
    labels = np.zeros((rows, cont_len), np.int32)
    mask = np.zeros((rows, cont_len), bool)
    for r, (inp, cont) in enumerate(items):
        n, c = len(inp), len(cont)
        tokens[r, :n] = inp
        positions[r, :c] = np.arange(n - c, n)
        labels[r, :c] = cont
        mask[r, :c] = True
    return tokens, positions, labels, mask


def score_requests(model, requests, batch_size: int = 32, mesh: Mesh | None = None,
                   max_length: int | None = None, progress: bool = True, desc: str = "loglikelihood",
                   scan_layers: bool = True):
    """[(summed log-prob, is_greedy)] for each (context_ids, continuation_ids) request, in order.

    model: a `Decoder` (dense, converted or LoRA-merged; its `hidden_states` and `unembed` are
        used) or any nnx.Module returning logits [B, T, vocab].
    batch_size: rows per step, rounded up to a multiple of the mesh's "data" size.
    max_length: longest input the model reads (default: the config's context).
    scan_layers: run uniform layers as one scan (compiles once per shape instead of once per
        layer; holds a stacked copy of the layer weights), see `layer_scan`.

    Returns (results, stats): stats holds requests, tokens (unpadded inputs), padded_tokens,
    seconds (wall time, compilation included), compile_seconds (the first call of each new
    shape, which traces and compiles; near 0 when an earlier call compiled them), shapes,
    devices, batch_size.
    """
    mesh = make_mesh() if mesh is None else mesh
    n_data = dict(mesh.shape)["data"]
    rows = -(-max(1, batch_size) // n_data) * n_data
    cfg = getattr(model, "config", None)
    max_length = max_length or getattr(cfg, "max_position_embeddings", None) or 2048
    prepared = _prepare(requests, max_length)
    todo = [i for i, (_, cont) in enumerate(prepared) if cont]  # empty continuation: (0.0, True)
    # longest first, and within one length rung by continuation length: few (rung, slots) shapes
    rung = {i: length_bucket(len(prepared[i][0]), max_length) for i in todo}
    todo.sort(key=lambda i: (rung[i], len(prepared[i][1]), len(prepared[i][0])), reverse=True)
    slots = collections.defaultdict(int)  # one continuation width per rung: one shape per rung
    for i in todo:
        slots[rung[i]] = max(slots[rung[i]], _pow2_at_least(len(prepared[i][1])))
    results = [(0.0, True)] * len(prepared)

    graphdefs, states = layer_scan.placed_parts(model, mesh, scan_layers)
    sharding = NamedSharding(mesh, P("data"))
    stats = collections.Counter()
    shapes = set()
    pending = collections.deque()
    bar = tqdm(total=len(todo), unit="req", desc=desc, disable=not progress)

    def collect():
        idx, (logp, greedy) = pending.popleft()
        logp, greedy = np.asarray(logp, np.float64), np.asarray(greedy)
        for r, i in enumerate(idx):
            results[i] = (float(logp[r]), bool(greedy[r]))
        bar.update(len(idx))

    t_start = time.perf_counter()
    for start in range(0, len(todo), rows):
        idx = todo[start:start + rows]
        items = [prepared[i] for i in idx]
        length = max(rung[i] for i in idx)
        cont_len = max(slots[rung[i]] for i in idx)
        arrays = jax.device_put(_batch_arrays(items, rows, length, cont_len), sharding)
        stats["tokens"] += sum(len(inp) for inp, _ in items)
        stats["padded_tokens"] += rows * length
        t0 = time.perf_counter()
        out = _score_step(graphdefs, states, *arrays)
        if (length, cont_len) not in shapes:  # first call traces and compiles: time it apart
            shapes.add((length, cont_len))
            jax.block_until_ready(out)
            stats["compile_seconds"] += time.perf_counter() - t0
        pending.append((idx, out))
        if len(pending) > 1:
            collect()
    while pending:
        collect()
    bar.close()
    seconds = time.perf_counter() - t_start
    return results, {"requests": len(prepared), "tokens": stats["tokens"],
                     "padded_tokens": stats["padded_tokens"], "seconds": seconds,
                     "compile_seconds": stats["compile_seconds"], "shapes": len(shapes),
                     "devices": n_data, "batch_size": rows}

"""Log-likelihood of continuations given contexts (the zero-shot multiple-choice measure).

For each (context, continuation) pair of token lists: the summed log-probability of the
continuation's tokens and whether every one of them is the argmax (greedy) token, exactly as
lm-evaluation-harness computes them: the sequence is (context + continuation) cut from the
left to `max_length + 1` tokens, the model reads all but its last token, and the positions
that predict the continuation are scored.

Batching: requests that share their context (the choices of one question) share one row: the
context once, then each continuation (but its last token) as its own attention segment that
sees the context and itself (`causal_attention`'s `segments`), at the positions it would have
alone; that reads ~3x fewer tokens on ARC than one row a choice. Rows are sorted by length
and cut into batches of `batch_size` rows; each batch is right-padded to the next length of
a short geometric ladder, and its scored slots to the power of two that fits every row of
that rung, so each rung is one compiled shape. Right padding needs no mask in a causal
model: padded tokens come after every scored position, and padded slots are dropped from the
sums. Only the scored positions reach the LM head (in chunks of rows), so no [B, T, vocab]
logits exist. Rows are sharded over the mesh's "data" axis.
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

from cmoe_jax.data import length_bucket
from cmoe_jax.errors import InputError
from cmoe_jax.sharding import make_mesh, placed_split

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
            raise InputError("an empty context needs a prefix token (BOS or EOS) to condition on")
        return ([prefix_token], cont) if not cont or cont[0] != prefix_token else (cont[:1], cont[1:])
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = list(encode(context + continuation))
    n_context = len(encode(context))
    return whole[:n_context], whole[n_context:]


def _pow2_at_least(n: int, floor: int = 4) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def _scored_slots(model, tokens, positions, segments, slot_pos, labels):
    """Log-prob [B, C] of `labels` read at row positions `slot_pos`, and whether each is the
    argmax token."""
    b, c = slot_pos.shape
    h = model.hidden_states(tokens, positions, segments)
    picked = jnp.take_along_axis(h, slot_pos[..., None], axis=1).reshape(b * c, -1)
    rows = picked.shape[0]
    tile = min(_HEAD_ROWS, rows)
    pad = (-rows) % tile
    picked = jnp.pad(picked, ((0, pad), (0, 0))).reshape(-1, tile, picked.shape[-1])
    logits = jax.lax.map(lambda x: model.unembed(x).astype(jnp.float32), picked)
    logits = logits.reshape(rows + pad, -1)[:rows].reshape(b, c, -1)
    gold = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return gold - jax.nn.logsumexp(logits, axis=-1), jnp.argmax(logits, axis=-1) == labels


@functools.partial(jax.jit, static_argnums=0)
def _score_step(graphdef, state, *arrays):
    return _scored_slots(nnx.merge(graphdef, state), *arrays)


def _prepare(requests, max_length: int):
    """Per request: (the context as the model reads it, continuation ids).

    lm-eval's cut: the sequence (context + continuation) keeps its last `max_length + 1`
    tokens, the model reads all but the last; so the context it reads is that sequence
    without the continuation (shorter than the given context only when cut)."""
    prepared = []
    for i, (context, continuation) in enumerate(requests):
        context, continuation = list(context), list(continuation)
        if len(continuation) > max_length:
            raise InputError(f"request {i}: continuation of {len(continuation)} tokens exceeds "
                             f"the model's context of {max_length}")
        seq = (context + continuation)[-(max_length + 1):]
        if continuation and len(seq) <= len(continuation):
            raise InputError(f"request {i}: needs at least one context token before the continuation")
        prepared.append((tuple(seq[:len(seq) - len(continuation)]), continuation))
    return prepared


def _pack_rows(prepared, todo, max_length: int, share_context: bool):
    """Rows `(context, [request index, ...])`: requests whose model-read contexts are equal
    share one row (the context once, then each continuation but its last token, as its own
    attention segment), as long as the row fits `max_length`; otherwise one row a request."""
    groups = collections.defaultdict(list)
    for i in todo:
        groups[prepared[i][0] if share_context else (i,)].append(i)
    rows = []
    for members in groups.values():
        context = prepared[members[0]][0]
        row, length = [], len(context)
        for i in members:
            extra = len(prepared[i][1]) - 1
            if row and length + extra > max_length:
                rows.append((context, row))
                row, length = [], len(context)
            row.append(i)
            length += extra
        rows.append((context, row))
    return rows


def _row_length(prepared, row) -> tuple[int, int]:
    """(tokens the row holds, continuation slots it scores)."""
    context, members = row
    slots = sum(len(prepared[i][1]) for i in members)
    return len(context) + slots - len(members), slots


def _batch_arrays(prepared, batch, rows: int, length: int, slots: int):
    """int32 arrays for one batch of packed rows, right-padded; `owner` [rows, slots] is the
    request index of each scored slot (-1: padding). Missing rows are all padding."""
    tokens, positions, segments = (np.zeros((rows, length), np.int32) for _ in range(3))
    slot_pos, labels = np.zeros((rows, slots), np.int32), np.zeros((rows, slots), np.int32)
    owner = np.full((rows, slots), -1, np.int64)
    for r, (context, members) in enumerate(batch):
        n = len(context)
        tokens[r, :n], positions[r, :n] = context, np.arange(n)
        at, s = n, 0
        for seg, i in enumerate(members, start=1):
            cont = prepared[i][1]
            c = len(cont)
            tokens[r, at:at + c - 1] = cont[:-1]
            positions[r, at:at + c - 1] = np.arange(n, n + c - 1)
            segments[r, at:at + c - 1] = seg
            # the first token is predicted by the context's last position, the rest by the
            # segment's own tokens
            slot_pos[r, s:s + c] = [n - 1, *range(at, at + c - 1)]
            labels[r, s:s + c], owner[r, s:s + c] = cont, i
            at, s = at + c - 1, s + c
    return (tokens, positions, segments, slot_pos, labels), owner


class _Layout:
    """The packed rows, longest first, with each row's (tokens, slots) size and length rung,
    and one slot count per rung (the power of two that fits its every row): one compiled
    shape per rung."""

    def __init__(self, prepared, todo, max_length: int, share_context: bool):
        rows = _pack_rows(prepared, todo, max_length, share_context)
        self.size = {id(r): _row_length(prepared, r) for r in rows}
        self.rung = {id(r): length_bucket(self.size[id(r)][0], max_length) for r in rows}
        # longest first, and within one length rung by slots: few (rung, slots) shapes
        rows.sort(key=lambda r: (self.rung[id(r)], self.size[id(r)][1], self.size[id(r)][0]),
                  reverse=True)
        self.rows = rows
        self.slots = collections.defaultdict(int)
        for r in rows:
            self.slots[self.rung[id(r)]] = max(self.slots[self.rung[id(r)]],
                                               _pow2_at_least(self.size[id(r)][1]))

    def shape(self, batch) -> tuple[int, int]:
        """(row length, scored slots) of a batch of rows."""
        return (max(self.rung[id(r)] for r in batch),
                max(self.slots[self.rung[id(r)]] for r in batch))


class _Tally:
    """Per request: the summed log-prob (float64) and whether every token was the greedy one,
    filled from each step's output once it is ready."""

    def __init__(self, n: int, bar):
        self.sums, self.greedy_all, self.bar = np.zeros(n, np.float64), np.ones(n, bool), bar

    def add(self, owner, out) -> None:
        logp, greedy = out
        scored = owner >= 0
        np.add.at(self.sums, owner[scored], np.asarray(logp, np.float64)[scored])
        np.logical_and.at(self.greedy_all, owner[scored], np.asarray(greedy)[scored])
        self.bar.update(len(np.unique(owner[scored])))

    def results(self) -> list[tuple[float, bool]]:
        return [(float(s), bool(g)) for s, g in zip(self.sums, self.greedy_all)]


def _run_batches(graphdef, state, sharding, prepared, layout: _Layout, n_rows: int,
                 tally: _Tally) -> collections.Counter:
    """Score every batch of `n_rows` rows, dispatching the next step before reading the last
    one's output; counts tokens, padded tokens, shapes and the first calls' seconds."""
    stats = collections.Counter()
    shapes = set()
    pending = collections.deque()
    for start in range(0, len(layout.rows), n_rows):
        batch = layout.rows[start:start + n_rows]
        length, width = layout.shape(batch)
        arrays, owner = _batch_arrays(prepared, batch, n_rows, length, width)
        stats["tokens"] += sum(layout.size[id(r)][0] for r in batch)
        stats["padded_tokens"] += n_rows * length
        t0 = time.perf_counter()
        out = _score_step(graphdef, state, *jax.device_put(arrays, sharding))
        if (length, width) not in shapes:  # first call traces and compiles: time it apart
            shapes.add((length, width))
            jax.block_until_ready(out)
            stats["compile_seconds"] += time.perf_counter() - t0
        pending.append((owner, out))
        if len(pending) > 1:
            tally.add(*pending.popleft())
    while pending:
        tally.add(*pending.popleft())
    stats["shapes"] = len(shapes)
    return stats


def score_requests(model, requests, batch_size: int = 32, mesh: Mesh | None = None,
                   max_length: int | None = None, progress: bool = True, desc: str = "loglikelihood",
                   share_context: bool = True):
    """[(summed log-prob, is_greedy)] for each (context_ids, continuation_ids) request, in order.

    model: a `Decoder` (dense, converted or LoRA-merged; its `hidden_states` and `unembed`
        are used).
    batch_size: rows per step, rounded up to a multiple of the mesh's "data" size.
    max_length: longest input the model reads (default: the config's context).
    share_context: requests with the same context (the choices of one question) share a
        row, the context computed once (`_pack_rows`); False: one row a request. The
        numbers are the same either way (up to float32 summation order).

    Returns (results, stats): stats holds requests, rows, tokens (unpadded row tokens),
    padded_tokens, seconds (wall time, compilation included), compile_seconds (the first
    call of each new shape, which traces and compiles; near 0 when an earlier call compiled
    them), shapes, devices, batch_size.
    """
    mesh = make_mesh() if mesh is None else mesh
    n_data = dict(mesh.shape)["data"]
    n_rows = -(-max(1, batch_size) // n_data) * n_data
    cfg = getattr(model, "config", None)
    max_length = max_length or getattr(cfg, "max_position_embeddings", None) or 2048
    prepared = _prepare(requests, max_length)
    todo = [i for i, (_, cont) in enumerate(prepared) if cont]  # empty continuation: (0.0, True)
    layout = _Layout(prepared, todo, max_length, share_context)
    graphdef, state = placed_split(model, mesh)
    tally = _Tally(len(prepared), tqdm(total=len(todo), unit="req", desc=desc, disable=not progress))
    t_start = time.perf_counter()
    stats = _run_batches(graphdef, state, NamedSharding(mesh, P("data")), prepared, layout, n_rows, tally)
    tally.bar.close()
    seconds = time.perf_counter() - t_start
    return tally.results(), {"requests": len(prepared), "rows": len(layout.rows), "tokens": stats["tokens"],
                             "padded_tokens": stats["padded_tokens"], "seconds": seconds,
                             "compile_seconds": stats["compile_seconds"], "shapes": stats["shapes"],
                             "devices": n_data, "batch_size": n_rows}

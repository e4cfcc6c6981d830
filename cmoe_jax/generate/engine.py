"""Batched generation with a KV cache: one prefill of the prompts, then one jitted step a token.

Prompts are sorted by length and batched; a batch is left-padded to a rung of
`length_bucket` and read once (the prefill), then each step feeds every row's last token,
attending over the cache (`cmoe_jax.models.kv_cache`). The cache starts at a power of two
above the prompt and doubles when it fills, so a whole generation compiles a handful of
shapes, whatever its length. Greedy, or sampling with temperature, top-k and top-p from a
seed (reproducible: the step's key is the seed's folded with the batch and step numbers).
A row stops at a stop token, when `stop(ids)` says so, at `max_new_tokens`, or at the
model's context; the batch stops when all its rows have.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from cmoe_jax.data import length_bucket
from cmoe_jax.errors import InputError
from cmoe_jax.models.kv_cache import KVCache
from cmoe_jax.sharding import make_mesh, placed_split


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: temperature 0 is greedy (argmax); else the softmax of
    logits / temperature restricted to the `top_k` most likely tokens (0: all) and to the
    smallest set whose probability reaches `top_p` (1: all), drawn from `seed`."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0: no limit), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def choose(logits: jax.Array, key, temperature, top_k, top_p, greedy: bool) -> jax.Array:
    """Next token int32 [B] from logits [B, V] (see `Sampling`)."""
    logits = logits.astype(jnp.float32)
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    vocab = logits.shape[-1]
    logits = logits / temperature
    ranked = -jnp.sort(-logits, axis=-1)                                  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    ranked = jnp.where(jnp.arange(vocab) < k, ranked, -jnp.inf)           # top-k
    probs = jax.nn.softmax(ranked, axis=-1)
    kept = ((jnp.cumsum(probs, axis=-1) - probs) < top_p) | (top_p >= 1)  # top-p; keeps the first
    floor = jnp.min(jnp.where(kept & (ranked > -jnp.inf), ranked, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits >= floor, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class StepInput(NamedTuple):
    """One step's rows: `tokens [B, T]` to read, which of them are `real` (not left padding),
    their `positions`, and the cache `slot` the first of them is written at."""

    tokens: jax.Array
    real: jax.Array
    positions: jax.Array
    slot: jax.Array


class Knobs(NamedTuple):
    """`Sampling`'s temperature, top-k and top-p as device scalars (traced, not static)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array


def _step(graphdef, treedef, leaves, cache: KVCache, step: StepInput, key, knobs: Knobs, *, greedy: bool):
    """(next token [B] after the last column of `step.tokens [B, T]`, the cache with them
    written): the prefill (T = the padded prompt, slot 0) and every decode step (T = 1)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    cache = cache.mark(step.real, step.slot)
    h, cache = model.run_cached(step.tokens, step.positions, cache, step.slot)
    logits = model.unembed(h[:, -1:])[:, 0]
    return choose(logits, key, *knobs, greedy), cache


@functools.lru_cache(maxsize=8)
def _jitted_step(graphdef, treedef):
    """`_step` compiled for one model structure. The model's state goes in as a flat list of
    arrays: an unrolled model's nested state, flattened and its graph hashed at every call,
    costs a decode step more than its layers do at batch 1."""
    return jax.jit(functools.partial(_step, graphdef, treedef), static_argnames=("greedy",),
                   donate_argnums=(1,))


def _pow2_at_least(n: int, floor: int = 32) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Decoding:
    """How prompts are continued: at most `max_new_tokens` tokens a row, chosen by
    `sampling`; a row also ends at one of `stop_tokens`, once `stop(ids)` says its generated
    ids should end it (stop strings), or at `max_length` tokens with its prompt (default: the
    model's context; prompts are cut from the left to leave room for `max_new_tokens`).
    `batch_size` prompts run together."""

    max_new_tokens: int = 128
    sampling: Sampling = Sampling()
    stop_tokens: Sequence[int] = ()
    stop: Callable[[list[int]], bool] | None = None
    max_length: int | None = None
    batch_size: int = 8


def _checked_prompts(model, prompts, decoding: Decoding) -> tuple[list[list[int]], int]:
    """(the prompts cut from the left to leave room for the answer, the length limit)."""
    max_new_tokens = decoding.max_new_tokens
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    max_length = decoding.max_length or getattr(model.config, "max_position_embeddings", None) or 2048
    if max_new_tokens >= max_length:
        raise InputError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the "
                         f"model's context of {max_length} tokens")
    keep = max_length - max_new_tokens
    prompts = [list(p)[-keep:] for p in prompts]
    if any(not p for p in prompts):
        raise InputError("every prompt needs at least one token")
    return prompts, max_length


def generate(model, prompts: Sequence[Sequence[int]], decoding: Decoding = Decoding(), *,
             mesh: Mesh | None = None, on_token: Callable[[int, int], None] | None = None,
             progress: bool = False) -> list[list[int]]:
    """Continuations (token ids) of each prompt, a stop token included when one ended it.

    `on_token(i, token)` is called for every token of prompt i as it is made (streaming).
    Rows are split over the mesh's "data" axis."""
    prompts, max_length = _checked_prompts(model, prompts, decoding)
    mesh = make_mesh() if mesh is None else mesh
    n_data = dict(mesh.shape)["data"]
    rows = -(-max(1, min(decoding.batch_size, len(prompts))) // n_data) * n_data
    graphdef, state = placed_split(model, mesh)
    max_new_tokens, stop = decoding.max_new_tokens, decoding.stop
    stop_tokens = frozenset(int(t) for t in decoding.stop_tokens)
    outputs: list[list[int]] = [[] for _ in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    bar = tqdm(total=len(prompts), unit="req", desc="generate", disable=not progress)
    run = _Batch(graphdef, state, model, mesh, rows, decoding.sampling, max_new_tokens, max_length)
    for b, start in enumerate(range(0, len(order), rows)):
        chosen = order[start:start + rows]

        def finished(i, token):
            outputs[i].append(token)
            if on_token is not None:
                on_token(i, token)
            full = len(prompts[i]) + len(outputs[i]) >= max_length
            done = (token in stop_tokens or len(outputs[i]) >= max_new_tokens or full
                    or (stop is not None and stop(outputs[i])))
            bar.update(int(done))
            return done

        run(b, [prompts[i] for i in chosen], lambda r, token: finished(chosen[r], token))
    bar.close()
    return outputs


class _Batch:
    """Runs one batch of prompts to the end (the prefill, then decode steps)."""

    def __init__(self, graphdef, state, model, mesh, rows, sampling, max_new_tokens, max_length):
        self.leaves, treedef = jax.tree.flatten(state)
        self.step = _jitted_step(graphdef, treedef)
        self.empty_cache = model.empty_cache
        self.rows, self.sampling = rows, sampling
        self.max_new_tokens, self.max_length = max_new_tokens, max_length
        self.rows_sharding = NamedSharding(mesh, P("data"))
        # rows split over "data" in every layout: [B K, S, H] arrays on their first axis,
        # [n or L, B, K, S, H] ones on their second
        rows_of = lambda a: NamedSharding(mesh, P("data") if a.ndim == 3 else P(None, "data"))
        kv = jax.tree.map(rows_of, model.empty_cache(1, 1).k)
        self.cache_sharding = KVCache(kv, kv, self.rows_sharding)
        s = sampling
        self.knobs = Knobs(jnp.float32(max(s.temperature, 1e-6)), jnp.int32(s.top_k), jnp.float32(s.top_p))

    def _call(self, cache, tokens, real, positions, slot, key):
        put = lambda a: jax.device_put(a, self.rows_sharding)
        step = StepInput(put(tokens), put(real), put(positions), jnp.int32(slot))
        return self.step(self.leaves, cache, step, key, self.knobs, greedy=self.sampling.greedy)

    def __call__(self, batch_index: int, prompts: list[list[int]], emit) -> None:
        """`emit(row, token) -> done` for each row's new token until every row is done."""
        n = len(prompts)
        width = length_bucket(max(map(len, prompts)), self.max_length)
        tokens = np.zeros((self.rows, width), np.int32)
        real = np.zeros((self.rows, width), bool)
        for r, p in enumerate(prompts):
            tokens[r, width - len(p):], real[r, width - len(p):] = p, True
        positions = np.maximum(np.cumsum(real, axis=1) - 1, 0).astype(np.int32)
        limit = _pow2_at_least(width + self.max_new_tokens)
        cache = jax.device_put(self.empty_cache(self.rows, min(limit, _pow2_at_least(width + 1))),
                               self.cache_sharding)
        key = jax.random.fold_in(jax.random.PRNGKey(self.sampling.seed), batch_index)
        nxt, cache = self._call(cache, tokens, real, positions, 0, jax.random.fold_in(key, 0))
        position = real.sum(axis=1).astype(np.int32)
        slot, done = width, [False] * n
        ones = np.ones((self.rows, 1), bool)
        for step in range(1, self.max_new_tokens + 1):
            last = np.asarray(nxt)
            done = [d or emit(r, int(last[r])) for r, d in enumerate(done)]
            if all(done) or step == self.max_new_tokens:
                return
            if slot == cache.length:
                cache = jax.device_put(cache.grow(min(limit, 2 * cache.length)), self.cache_sharding)
            nxt, cache = self._call(cache, last[:, None].astype(np.int32), ones, position[:, None],
                                    slot, jax.random.fold_in(key, step))
            position, slot = position + 1, slot + 1


"""Token dispatch for routed experts: sort by expert, grouped matmuls, unsort, combine.

Three ways to run the same (token, expert) pairs, chosen by `cmoe_jax.moe.modes`:
`routed_experts` (sort, the general path), `gathered_experts` (few pairs: each reads its own
expert's weights) and `dense_experts` (every expert on every token, the unchosen ones
weighted zero: where most of the experts are active anyway, one wide product beats the
sort).

Static shapes. A dropped pair (expert id E, gate 0: `cmoe_jax.moe.token_pairs`) runs nothing
and counts in no load on every path. The sort path: the `T * k` (token, slot) pairs are stably sorted by expert id, their rows gathered into one `[T*k, d]`
matrix grouped by expert, run through the experts' SwiGLU with three grouped matmuls, scaled
by their gate weights and gathered back with the inverse permutation. The result equals the
per-token sum over the selected experts of `gate * expert(x)`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from cmoe_jax.moe.activations import glu_activation


class Dispatch(NamedTuple):
    order: jax.Array        # int32 [T*k]: sorted position -> flat (token, slot) index
    inverse: jax.Array      # int32 [T*k]: flat (token, slot) index -> sorted position
    group_sizes: jax.Array  # int32 [E]: rows per expert (= tokens routed to it)


# the counting sort's [pairs, E + 1] one-hot prefix sum beats a full argsort up to this many
# experts and from this many pairs (2-4x at 128 to 49152 pairs on the CPU; slower at 16 experts
# or more, and at a few dozen pairs): benchmarks/moe_breakdown.py
COUNTING_MAX_EXPERTS, COUNTING_MIN_PAIRS = 8, 128


@jax.named_scope("dispatch")
def plan(expert_ids: jax.Array, num_experts: int) -> Dispatch:
    """Sort the flattened (token, slot) pairs `expert_ids [T, k]` by expert id (stable); a
    dropped pair's id `num_experts` sorts after every group."""
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    if num_experts <= COUNTING_MAX_EXPERTS and flat.shape[0] >= COUNTING_MIN_PAIRS:
        return counting_plan(flat, num_experts)
    return sorting_plan(flat, num_experts)


def sorting_plan(flat: jax.Array, num_experts: int) -> Dispatch:
    """`plan` by a stable argsort of the flat expert ids."""
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return Dispatch(order, inverse, sizes)


def counting_plan(flat: jax.Array, num_experts: int) -> Dispatch:
    """`plan` by counting: a pair's sorted position is its expert's offset plus the number of
    earlier pairs of that expert (a prefix sum over a one-hot `[pairs, E + 1]`), the same
    stable order as the argsort without sorting."""
    onehot = (flat[:, None] == jnp.arange(num_experts + 1, dtype=jnp.int32)).astype(jnp.int32)
    counts = onehot.sum(0)
    before = jnp.cumsum(onehot, axis=0) - onehot
    inverse = jnp.sum((before + (jnp.cumsum(counts) - counts)) * onehot, axis=1)
    order = jnp.zeros_like(inverse).at[inverse].set(jnp.arange(flat.shape[0], dtype=jnp.int32))
    return Dispatch(order, inverse, counts[:num_experts])


@dataclasses.dataclass(frozen=True)
class GLUExperts:
    """The routed experts and how they run: `w_gate`, `w_up` `[E, d, m]` and `w_down`
    `[E, m, d]`; `gmm(lhs, rhs, sizes)` a grouped-matmul backend (`cmoe_jax.moe.gmm.get_gmm`);
    `lora(name, rows, group_sizes)`, optional, adds a low-rank delta to the projection `name`
    ("gate", "up" or "down") of the sorted rows (or returns None for none): LoRA adapters
    stacked per expert run through the same grouped matmuls (`cmoe_jax.train`);
    `activation` a `cmoe_jax.moe.activations` name; `glu(x, src, w_gate, w_up, sizes, act)`,
    optional, a backend's fused gather + gate + up + activation (`cmoe_jax.moe.gmm.get_glu`),
    used when there are no adapters; `capacity`, optional, the most pairs of one device's
    tokens an expert runs (a capacity factor's: it bounds the expert-parallel buffers)."""

    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array
    gmm: Callable
    activation: str
    lora: Callable | None = None
    glu: Callable | None = None
    capacity: int | None = None

    @property
    def weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self.w_gate, self.w_up, self.w_down


def routed_experts(x: jax.Array, expert_ids: jax.Array, gates: jax.Array, experts: GLUExperts
                   ) -> tuple[jax.Array, jax.Array]:
    """sum_k gates[t, k] * expert_{ids[t, k]}(x[t]) for `x [T, d]`; also the group sizes.

    The k expert outputs of a token are summed in float32.
    """
    num_tokens, top_k = expert_ids.shape
    d = plan(expert_ids, experts.w_gate.shape[0])
    if experts.glu is not None and experts.lora is None:
        with jax.named_scope("experts"):  # the backend's fused gather, gate and up
            h = experts.glu(x, d.order // top_k, experts.w_gate, experts.w_up, d.group_sizes,
                            glu_activation(experts.activation))
            ys = experts.gmm(h, experts.w_down, d.group_sizes)
    else:
        with jax.named_scope("dispatch"):
            rows = x[d.order // top_k]
        ys = expert_swiglu(rows, d.group_sizes, experts)
    return combine(ys, gates, d.inverse), d.group_sizes


@jax.named_scope("experts")
def expert_swiglu(rows: jax.Array, group_sizes: jax.Array, experts: GLUExperts) -> jax.Array:
    """Each expert's GLU on its rows (`rows` sorted by expert, `group_sizes [E]`)."""
    gmm, lora = experts.gmm, experts.lora

    def proj(name, inp, w):
        y = gmm(inp, w, group_sizes)
        delta = lora(name, inp, group_sizes) if lora is not None else None
        return y if delta is None else y + delta.astype(y.dtype)

    h = glu_activation(experts.activation)(proj("gate", rows, experts.w_gate)) * proj("up", rows, experts.w_up)
    return proj("down", h.astype(rows.dtype), experts.w_down)


@jax.named_scope("combine")
def combine(ys: jax.Array, gates: jax.Array, rows: jax.Array | None = None,
            ran: jax.Array | None = None) -> jax.Array:
    """float32 `[T, d]`: sum over slots of `gates [T, k]` times the slot outputs, `ys [T*k, d]`
    in (token, slot) order or, with `rows [T*k]`, row `rows[t*k + j]` of `ys` for pair (t, j);
    a pair whose `ran [T*k]` is False adds exactly 0 (its row may hold another pair's output).

    Slot by slot, each a gather, scale and add that XLA fuses into one pass: the einsum over
    a gathered `[T, k, d]` wrote and re-read that copy (XLA:CPU, the sort path's unsort and
    combine at 576x1536, 4096 tokens, S3A3E8: 4.6-5.4 ms to 0.66-0.77 ms;
    benchmarks/moe_breakdown.py)."""
    num_tokens, top_k = gates.shape
    g = gates.astype(jnp.float32)
    if rows is None:
        slot = lambda j: ys.reshape(num_tokens, top_k, -1)[:, j]  # noqa: E731
    else:
        slot = lambda j: ys[rows.reshape(num_tokens, top_k)[:, j]]  # noqa: E731

    def term(j):
        y = slot(j).astype(jnp.float32) * g[:, j:j + 1]
        return y if ran is None else jnp.where(ran.reshape(num_tokens, top_k)[:, j:j + 1], y, 0.0)

    out = term(0)
    for j in range(1, top_k):
        out = out + term(j)
    return out


def gathered_experts(x: jax.Array, ids: jax.Array, gates: jax.Array, w_gate: jax.Array,
                     w_up: jax.Array, w_down: jax.Array, activation: str, slabs: Slabs | None = None
                     ) -> tuple[jax.Array, jax.Array]:
    """`routed_experts` for few tokens: each (token, slot) pair multiplies its own expert's
    weights, gathered from the stacked `[E, ...]` tensors, so only the chosen experts are
    read. Same products, dtypes and float32 combine as the sort dispatch.

    With `slabs` each product reads its experts' slices a slab of rows at a time
    (`pair_products`): XLA:CPU copies a sliced operand before its product, and a slab's copy
    stays in cache where a whole expert's goes to memory and back. Not for weights that are
    themselves slices (a layer in a scan over stacked layers): the slabs' loop takes them
    as its operand, which XLA copies whole, every expert (`cmoe_jax.moe.modes.sliced_weights`)."""
    num_tokens, top_k = ids.shape
    num_experts = w_gate.shape[0]
    with jax.named_scope("dispatch"):
        flat = jnp.minimum(ids.reshape(-1), num_experts - 1)  # a dropped pair (id E, gate 0) reads any
        rows = jnp.repeat(x, top_k, axis=0)                                   # [T*k, d]
    mm = lambda a, w: pair_products(a, w, flat, slabs).astype(a.dtype)  # noqa: E731
    with jax.named_scope("experts"):
        h = glu_activation(activation)(mm(rows, w_gate)) * mm(rows, w_up)
        ys = mm(h.astype(rows.dtype), w_down)
    return combine(ys, gates), jnp.bincount(ids.reshape(-1), length=num_experts).astype(jnp.int32)


class Slabs(NamedTuple):
    """How `pair_products` cuts an expert's slice: slabs of at most `max_bytes` each, in at
    most `max_steps` loop steps (the loop's fixed cost a step bounds how small they get);
    slices of at most `min_bytes` stay whole (their copy stays in cache anyway, and the
    loop's steps cost)."""

    max_bytes: int
    max_steps: int
    min_bytes: int = 0


def pair_products(a: jax.Array, w: jax.Array, experts: jax.Array, slabs: Slabs | None = None) -> jax.Array:
    """float32 `[P, n]`: row p of `a [P, K]` times its expert's `w[experts[p]] [K, n]`; with
    `slabs`, summed over slabs of K (`slab_steps`), each pair's slab sliced in place of its
    whole expert."""
    pairs, depth = a.shape
    n = w.shape[-1]
    steps = 1 if slabs is None else slab_steps(depth, depth * n * w.dtype.itemsize, slabs)
    if steps == 1:
        return jnp.einsum("pk,pkn->pn", a, jnp.take(w, experts, axis=0), preferred_element_type=jnp.float32)
    rows = depth // steps

    def step(i, acc):  # a loop, so that every step's slab reuses one buffer, in cache
        ws = jax.vmap(lambda e: jax.lax.dynamic_slice(w, (e, i * rows, 0), (1, rows, n))[0])(experts)
        part = jax.lax.dynamic_slice_in_dim(a, i * rows, rows, axis=1)
        return acc + jnp.einsum("pk,pkn->pn", part, ws, preferred_element_type=jnp.float32)

    return jax.lax.fori_loop(0, steps, step, jnp.zeros((pairs, n), jnp.float32))


def slab_steps(depth: int, expert_bytes: int, slabs: Slabs) -> int:
    """The fewest slabs, a divisor of `depth`, of at most `slabs.max_bytes` of an expert's
    `expert_bytes` each; where that takes more than `slabs.max_steps`, the most slabs within
    it (1 when the whole expert fits, or is at most `slabs.min_bytes`)."""
    if expert_bytes <= slabs.min_bytes:
        return 1
    divisors = [s for s in range(1, min(depth, slabs.max_steps) + 1) if depth % s == 0]
    return next((s for s in divisors if expert_bytes <= s * slabs.max_bytes), divisors[-1])


def dense_experts(x: jax.Array, ids: jax.Array, gates: jax.Array, w_gate: jax.Array,
                  w_up: jax.Array, w_down: jax.Array, activation: str
                  ) -> tuple[jax.Array, jax.Array]:
    """`routed_experts` as one wide GLU over all E experts: each hidden unit of expert e is
    scaled by the token's gate for e (zero when e was not chosen) before the down
    projection, so `down(sum_e g_e h_e) = sum_e g_e down(h_e)`. No sort, no gathers; costs
    E/k times the routed products, which pays where k/E is large or tokens are few."""
    num_tokens, _ = ids.shape
    num_experts = w_gate.shape[0]
    with jax.named_scope("dispatch"):  # each token's gate on every expert (0: not chosen)
        weight = jnp.zeros((num_tokens, num_experts), jnp.float32).at[
            jnp.arange(num_tokens)[:, None], ids].add(gates.astype(jnp.float32))
        # batched over experts with the tokens broadcast: "td,edm" would transpose (copy) every
        # expert's weights first, which at few tokens costs more than the products
        xs = jnp.broadcast_to(x, (num_experts,) + x.shape)
    mm = lambda w: jnp.einsum("etd,edm->etm", xs, w, preferred_element_type=jnp.float32)  # noqa: E731
    with jax.named_scope("experts"):
        h = glu_activation(activation)(mm(w_gate)) * mm(w_up)                 # [E, T, m] f32
    with jax.named_scope("combine"):  # the gates scale the hidden units; the down projection sums
        h = (h * weight.T[:, :, None]).astype(x.dtype)
        y = jnp.einsum("etm,emd->td", h, w_down, preferred_element_type=jnp.float32)
    return y, jnp.bincount(ids.reshape(-1), length=num_experts).astype(jnp.int32)

"""Grouped matmul for CPU: a loop over experts, each a loop over dense row windows.

`jax.lax.ragged_dot` lowers on CPU to a masked dense product against every group, so it
costs as much as the dense FFN (about 8x one expert's work at 8 groups). Here each expert
multiplies only its own rows: an outer `fori_loop` over experts, an inner loop over
`block`-row windows of that expert's rows (full blocks, then `tail`-row windows for the
rest), each a dense `[block, K] @ [K, N]` dot. A window writes only the rows of its own
group (a select against what is already there), so windows may run past their group and
are clamped at the matrix's end instead of reading a padded copy of `lhs`: padding cost as
much as the products themselves at SmolLM2's width (a copy XLA fuses into every window's
read). At most `tail - 1` rows per expert are computed and discarded. Exact (the same dots
as the dense reference).

Loops with data-dependent trip counts are not reverse-differentiable, so gradients go
through `gmm_vjp.differentiable_gmm` (d lhs = gmm with transposed weights, d rhs = `tgmm`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cmoe_jax.moe.gmm.vjp import differentiable_gmm, varying_axes

BLOCK = 512  # rows per full window: large enough for an efficient dot, measured on 2 cores
TAIL = 32    # rows per window for the remainder of a group


def _dot(a, w, transpose_w):
    dims = (((1,), (1,)), ((), ())) if transpose_w else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(a, w, dims, preferred_element_type=jnp.float32)


def _compute_dtype(*arrays):
    # XLA:CPU upcasts half-precision dot operands itself, per dot: upcasting once per call
    # (and the weights once per expert) gives the same float32 products far faster.
    return jnp.float32 if any(a.dtype in (jnp.bfloat16, jnp.float16) for a in arrays) else None


def _zeros(shape, dtype, *like):
    """Zeros for a loop carry, varying over the same shard_map axes as `like` (else the
    carry's type changes in the loop when the inputs are per-device blocks)."""
    axes = tuple(sorted(varying_axes(*like)))
    out = jnp.zeros(shape, dtype)
    return jax.lax.pcast(out, axes, to="varying") if axes else out


def _bounds(group_sizes):
    group_sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(group_sizes)
    return ends - group_sizes, group_sizes, ends


def _windows(num_rows, group_sizes, block, tail, visit, carry, per_group=lambda e: None):
    """Run `visit(g, rows, r0, keep, carry)` over every window of every group: `rows` static
    (`block` or `tail`, at most `num_rows`), `r0` the window's first row, clamped so the
    window fits, and `keep [rows]` bool, true for the rows of group `e` that no earlier
    window of the group covered."""
    if num_rows == 0:
        return carry
    block, tail = min(block, num_rows), min(tail, num_rows)
    starts, sizes, ends = _bounds(group_sizes)

    def window(e, g, rows, first, i, carry):
        want = first + i * rows                      # unclamped start
        r0 = jnp.clip(want, 0, num_rows - rows)
        idx = r0 + jnp.arange(rows)
        return visit(g, rows, r0, (idx >= jnp.maximum(starts[e], want)) & (idx < ends[e]), carry)

    def group(e, carry):
        g, full = per_group(e), sizes[e] // block
        carry = jax.lax.fori_loop(0, full, lambda i, c: window(e, g, block, starts[e], i, c), carry)
        s2 = starts[e] + full * block
        rest = (ends[e] - s2 + tail - 1) // tail
        return jax.lax.fori_loop(0, rest, lambda i, c: window(e, g, tail, s2, i, c), carry)

    return jax.lax.fori_loop(0, group_sizes.shape[0], group, carry)


def gmm_impl(lhs, rhs, group_sizes, transpose_rhs=False, *, block=BLOCK, tail=TAIL):
    """out[rows of g] = lhs[rows of g] @ rhs[g] (rhs[g].T if transpose_rhs); other rows 0."""
    m = lhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    up = _compute_dtype(lhs, rhs)
    a = lhs.astype(up) if up else lhs

    def visit(w, rows, r0, keep, out):
        y = _dot(jax.lax.dynamic_slice_in_dim(a, r0, rows), w, transpose_rhs).astype(out.dtype)
        y = jnp.where(keep[:, None], y, jax.lax.dynamic_slice_in_dim(out, r0, rows))
        return jax.lax.dynamic_update_slice_in_dim(out, y, r0, 0)

    out = _zeros((m, n), up or lhs.dtype, lhs, rhs, group_sizes)
    weight = lambda e: rhs[e].astype(up) if up else rhs[e]
    return _windows(m, group_sizes, block, tail, visit, out, weight).astype(lhs.dtype)


def tgmm_impl(lhs, rhs, group_sizes, *, block=BLOCK, tail=TAIL):
    """out[g] = lhs[rows of g]^T @ rhs[rows of g]: [G, K, N] in float32 accumulation."""
    k, n = lhs.shape[1], rhs.shape[1]
    up = _compute_dtype(lhs, rhs)
    a, b = (lhs.astype(up), rhs.astype(up)) if up else (lhs, rhs)
    dims = (((0,), (0,)), ((), ()))

    def visit(e, rows, r0, keep, out):
        x = jax.lax.dynamic_slice_in_dim(a, r0, rows)
        x = jnp.where(keep[:, None], x, jnp.zeros((), x.dtype))
        y = jax.lax.dot_general(x, jax.lax.dynamic_slice_in_dim(b, r0, rows), dims,
                                preferred_element_type=jnp.float32)
        return out.at[e].add(y.astype(out.dtype))

    out = _zeros((group_sizes.shape[0], k, n), jnp.float32, lhs, rhs, group_sizes)
    out = _windows(lhs.shape[0], group_sizes, block, tail, visit, out, per_group=lambda e: e)
    return out.astype(jnp.promote_types(lhs.dtype, rhs.dtype))


def make_gmm(block: int = BLOCK, tail: int = TAIL):
    """A differentiable CPU grouped matmul with the given row-window sizes."""
    return differentiable_gmm(functools.partial(gmm_impl, block=block, tail=tail),
                              functools.partial(tgmm_impl, block=block, tail=tail))


gmm = make_gmm()
gmm.__doc__ = "Differentiable CPU grouped matmul: `gmm(lhs [M,K], rhs [G,K,N], group_sizes [G]) -> [M,N]`."

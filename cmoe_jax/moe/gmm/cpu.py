"""Grouped matmul for CPU: a loop over experts, each a loop over dense row blocks.

`jax.lax.ragged_dot` lowers on CPU to a masked dense product against every group, so it
costs as much as the dense FFN (about 8x one expert's work at 8 groups). Here each expert
multiplies only its own rows: an outer `fori_loop` over experts, an inner loop over
`block`-row windows of that expert's rows (full blocks, then `tail`-row blocks for the
rest), each a dense `[block, K] @ [K, N]` dot. Experts are visited in row order, so the
rows a last partial window writes past its group belong to a later group and are
overwritten when that group is computed; no masking is needed on the forward pass and at
most `tail - 1` rows per expert are wasted. Exact (same dots as the dense reference).

Loops with data-dependent trip counts are not reverse-differentiable, so gradients go
through `gmm_vjp.differentiable_gmm` (d lhs = gmm with transposed weights, d rhs = `tgmm`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cmoe_jax.moe.gmm.vjp import differentiable_gmm, varying_axes

BLOCK = 256  # rows per full block: large enough for an efficient dot, measured on 2 cores
TAIL = 32    # rows per block for the remainder of a group


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
    return ends - group_sizes, group_sizes, ends[-1]


def gmm_impl(lhs, rhs, group_sizes, transpose_rhs=False, *, block=BLOCK, tail=TAIL):
    """out[rows of g] = lhs[rows of g] @ rhs[g] (rhs[g].T if transpose_rhs); other rows 0."""
    m, _ = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    starts, sizes, total = _bounds(group_sizes)
    pad = max(block, tail)
    up = _compute_dtype(lhs, rhs)
    lhs_p = jnp.pad(lhs, ((0, pad), (0, 0)))
    lhs_p = lhs_p.astype(up) if up else lhs_p
    out = _zeros((m + pad, n), lhs.dtype, lhs, rhs, group_sizes)

    def window(rows, out, w, r0):
        y = _dot(jax.lax.dynamic_slice_in_dim(lhs_p, r0, rows), w, transpose_rhs)
        return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), r0, 0)

    def expert(e, out):
        w = rhs[e].astype(up) if up else rhs[e]
        s, size = starts[e], sizes[e]
        full = size // block
        out = jax.lax.fori_loop(0, full, lambda i, o: window(block, o, w, s + i * block), out)
        s2 = s + full * block
        rest = (size - full * block + tail - 1) // tail
        return jax.lax.fori_loop(0, rest, lambda i, o: window(tail, o, w, s2 + i * tail), out)

    out = jax.lax.fori_loop(0, rhs.shape[0], expert, out)[:m]
    return jnp.where((jnp.arange(m) < total)[:, None], out, jnp.zeros((), out.dtype))


def tgmm_impl(lhs, rhs, group_sizes, *, block=BLOCK, tail=TAIL):
    """out[g] = lhs[rows of g]^T @ rhs[rows of g]: [G, K, N] in float32 accumulation."""
    k, n = lhs.shape[1], rhs.shape[1]
    num_groups = group_sizes.shape[0]
    starts, sizes, _ = _bounds(group_sizes)
    pad = max(block, tail)
    up = _compute_dtype(lhs, rhs)
    lhs_p = jnp.pad(lhs, ((0, pad), (0, 0)))
    rhs_p = jnp.pad(rhs, ((0, pad), (0, 0)))
    if up:
        lhs_p, rhs_p = lhs_p.astype(up), rhs_p.astype(up)
    dims = (((0,), (0,)), ((), ()))

    def window(rows, acc, r0, end):
        a = jax.lax.dynamic_slice_in_dim(lhs_p, r0, rows)
        a = jnp.where((r0 + jnp.arange(rows) < end)[:, None], a, jnp.zeros((), a.dtype))
        b = jax.lax.dynamic_slice_in_dim(rhs_p, r0, rows)
        return acc + jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

    def expert(e, out):
        s, size = starts[e], sizes[e]
        end = s + size
        full = size // block
        acc = _zeros((k, n), jnp.float32, lhs, rhs, group_sizes)
        acc = jax.lax.fori_loop(0, full, lambda i, a: window(block, a, s + i * block, end), acc)
        s2 = s + full * block
        rest = (size - full * block + tail - 1) // tail
        acc = jax.lax.fori_loop(0, rest, lambda i, a: window(tail, a, s2 + i * tail, end), acc)
        return jax.lax.dynamic_update_index_in_dim(out, acc.astype(out.dtype), e, 0)

    out = _zeros((num_groups, k, n), jnp.promote_types(lhs.dtype, rhs.dtype), lhs, rhs, group_sizes)
    return jax.lax.fori_loop(0, num_groups, expert, out)


def make_gmm(block: int = BLOCK, tail: int = TAIL):
    """A differentiable CPU grouped matmul with the given row-block sizes."""
    return differentiable_gmm(functools.partial(gmm_impl, block=block, tail=tail),
                              functools.partial(tgmm_impl, block=block, tail=tail))


gmm = make_gmm()
gmm.__doc__ = "Differentiable CPU grouped matmul: `gmm(lhs [M,K], rhs [G,K,N], group_sizes [G]) -> [M,N]`."

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

WINDOWS = (512, 128, 32)  # rows per window, largest first: large enough for an efficient dot, measured on 2 cores


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


def _levels(num_rows: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The window sizes used for `num_rows` rows: each at most `num_rows`, no repeats."""
    return tuple(dict.fromkeys(min(s, num_rows) for s in sizes))


def _windows(num_rows, group_sizes, sizes, visit, carry, per_group=lambda e: e):
    """Run `visit(per_group(e), rows, r0, keep, carry)` over every window of every group.

    A group's rows are covered by windows of the `sizes` in turn (largest first: as many
    whole windows of each as fit, the last size rounding up), so at most `sizes[-1] - 1`
    rows are computed and dropped per group. One flat loop per size runs that size's windows
    of all groups (an XLA:CPU loop step costs about as much as a small dot: nested loops
    over groups and windows cost more than the products at small token counts). `rows` is
    static, `r0` the window's first row, clamped so the window fits, and `keep [rows]` bool,
    true for the rows of group `e` that no other window of the group covers."""
    if num_rows == 0:
        return carry
    levels = _levels(num_rows, sizes)
    starts, lengths, ends = _bounds(group_sizes)
    first, left = starts, lengths
    for n, size in enumerate(levels):
        count = left // size if n < len(levels) - 1 else (left + size - 1) // size
        cum = jnp.cumsum(count)

        def window(i, carry, size=size, first=first, count=count, cum=cum):
            e = jnp.searchsorted(cum, i, side="right", method="compare_all")  # no inner loop
            want = first[e] + (i - (cum[e] - count[e])) * size      # unclamped start
            r0 = jnp.clip(want, 0, num_rows - size)
            idx = r0 + jnp.arange(size)
            keep = (idx >= jnp.maximum(starts[e], want)) & (idx < ends[e])
            return visit(per_group(e), size, r0, keep, carry)

        carry = jax.lax.fori_loop(0, cum[-1], window, carry)
        first, left = first + count * size, jnp.maximum(left - count * size, 0)
    return carry


def gmm_impl(lhs, rhs, group_sizes, transpose_rhs=False, *, windows=WINDOWS):
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
    return _windows(m, group_sizes, windows, visit, out, weight).astype(lhs.dtype)


def tgmm_impl(lhs, rhs, group_sizes, *, windows=WINDOWS):
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
    out = _windows(lhs.shape[0], group_sizes, windows, visit, out)
    return out.astype(jnp.promote_types(lhs.dtype, rhs.dtype))


def make_gmm(windows: tuple[int, ...] = WINDOWS):
    """A differentiable CPU grouped matmul with the given row-window sizes (largest first)."""
    windows = tuple(windows)
    if not windows or any(w < 1 for w in windows) or list(windows) != sorted(windows, reverse=True):
        raise ValueError(f"windows must be positive sizes, largest first, got {windows}")
    return differentiable_gmm(functools.partial(gmm_impl, windows=windows),
                              functools.partial(tgmm_impl, windows=windows))


gmm = make_gmm()
gmm.__doc__ = "Differentiable CPU grouped matmul: `gmm(lhs [M,K], rhs [G,K,N], group_sizes [G]) -> [M,N]`."


def glu_impl(x, src, w_gate, w_up, group_sizes, activation, *, windows=WINDOWS):
    """`act(x[src] @ w_gate[g]) * (x[src] @ w_up[g])` per group `g` of rows, `[M, m]`: the
    gather of the token rows, both projections and the activation in one pass over each
    window (a quarter of the routed experts' time at SmolLM2's width went into writing and
    re-reading the gathered rows and the two projections). Rows past the groups are 0."""
    up = _compute_dtype(x, w_gate)
    a = x.astype(up) if up else x
    m, n = src.shape[0], w_gate.shape[2]

    def visit(e, rows, r0, keep, out):
        tok = jnp.take(a, jax.lax.dynamic_slice_in_dim(src, r0, rows), axis=0)
        proj = lambda w: _dot(tok, w[e].astype(up) if up else w[e], False).astype(x.dtype)  # noqa: E731
        h = (activation(proj(w_gate)) * proj(w_up)).astype(out.dtype)
        h = jnp.where(keep[:, None], h, jax.lax.dynamic_slice_in_dim(out, r0, rows))
        return jax.lax.dynamic_update_slice_in_dim(out, h, r0, 0)

    out = _zeros((m, n), up or x.dtype, x, w_gate, group_sizes)
    return _windows(m, group_sizes, windows, visit, out).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def glu(x, src, w_gate, w_up, group_sizes, activation):
    """Differentiable `glu_impl`; the backward pass recomputes the unfused form (gather,
    two grouped matmuls, activation) and differentiates that."""
    return glu_impl(x, src, w_gate, w_up, group_sizes, activation)


def _glu_reference(x, src, w_gate, w_up, group_sizes, activation):
    rows = x[src]
    return (activation(gmm(rows, w_gate, group_sizes)) * gmm(rows, w_up, group_sizes)).astype(x.dtype)


def _glu_fwd(x, src, w_gate, w_up, group_sizes, activation):
    return glu_impl(x, src, w_gate, w_up, group_sizes, activation), (x, src, w_gate, w_up, group_sizes)


def _glu_bwd(activation, res, ct):
    x, src, w_gate, w_up, group_sizes = res
    _, vjp = jax.vjp(lambda x, wg, wu: _glu_reference(x, src, wg, wu, group_sizes, activation),
                     x, w_gate, w_up)
    dx, dg, du = vjp(ct)
    return dx, None, dg, du, None


glu.defvjp(_glu_fwd, _glu_bwd)

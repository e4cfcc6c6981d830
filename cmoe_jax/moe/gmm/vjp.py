"""One custom_vjp shared by the grouped-matmul backends that are not differentiable by themselves.

A backend supplies two kernels over rows sorted by group (`group_sizes[g]` consecutive rows
per group, rows past `sum(group_sizes)` belong to no group):

- ``gmm(lhs [M, K], rhs [G, K, N] or [G, N, K] if transpose_rhs, sizes) -> [M, N]``
- ``tgmm(lhs [M, K], rhs [M, N], sizes) -> [G, K, N]``, per group ``lhs[rows]^T @ rhs[rows]``

and gets a differentiable ``gmm``: d lhs is a gmm of the cotangent with the transposed
weights, d rhs is the transposed grouped matmul, the group sizes get no gradient. Loops
with data-dependent trip counts (CPU) and Pallas kernels (GPU) cannot be differentiated by
JAX, which is why this exists.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax


def varying_axes(*arrays) -> frozenset:
    """The shard_map axes over which any of `arrays` varies (empty outside shard_map)."""
    return frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in arrays))


def _like(ct, primal):
    """Cotangent `ct` with the manual-axis type of `primal`: summed over the axes the primal
    is invariant over (a weight shared by the devices gets their gradients' sum)."""
    extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
    ct = jax.lax.psum(ct, extra) if extra else ct
    missing = tuple(sorted(varying_axes(primal) - varying_axes(ct)))
    return jax.lax.pcast(ct, missing, to="varying") if missing else ct


def differentiable_gmm(gmm_impl: Callable, tgmm_impl: Callable) -> Callable:
    """Wrap `gmm_impl(lhs, rhs, sizes, transpose_rhs)` and `tgmm_impl(lhs, rhs, sizes)`."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def gmm(lhs, rhs, group_sizes, transpose_rhs=False):
        return gmm_impl(lhs, rhs, group_sizes, transpose_rhs)

    def fwd(lhs, rhs, group_sizes, transpose_rhs):
        return gmm_impl(lhs, rhs, group_sizes, transpose_rhs), (lhs, rhs, group_sizes)

    def bwd(transpose_rhs, res, g):
        lhs, rhs, group_sizes = res
        g = g.astype(lhs.dtype)
        d_lhs = gmm_impl(g, rhs, group_sizes, not transpose_rhs)
        if transpose_rhs:  # rhs [G, N, K]: per group g^T @ lhs
            d_rhs = tgmm_impl(g, lhs, group_sizes)
        else:
            d_rhs = tgmm_impl(lhs, g, group_sizes)
        return _like(d_lhs.astype(lhs.dtype), lhs), _like(d_rhs.astype(rhs.dtype), rhs), None

    gmm.defvjp(fwd, bwd)
    return gmm

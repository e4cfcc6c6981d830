"""Grouped matmul for TPU: the megablox Pallas kernels (gmm, tgmm) that ship with JAX.

megablox needs the row count to be a multiple of the row tile and leaves rows outside every
group unwritten (NaN in interpret mode, also in its own lhs gradient), so rows are
zero-padded, cut off and masked here, and the VJP is ours (`gmm_vjp`) around its gmm/tgmm.
"""
from __future__ import annotations

import functools
import importlib

import jax.numpy as jnp

from cmoe_jax.moe.gmm.vjp import differentiable_gmm

TILING = (128, 128, 128)  # (tm, tk, tn)


def _backend():
    # the package re-exports the custom_vjp `gmm` under the module's name, so import by path
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _row_tile(m: int, tm: int) -> tuple[int, int]:
    tm = min(tm, -(-m // 8) * 8)
    return tm, -(-m // tm) * tm


def gmm_impl(lhs, rhs, group_sizes, transpose_rhs=False, *, tiling=TILING, interpret=False):
    backend = _backend()

    m = lhs.shape[0]
    tm, mp = _row_tile(m, tiling[0])
    group_sizes = group_sizes.astype(jnp.int32)
    out = backend.gmm(jnp.pad(lhs, ((0, mp - m), (0, 0))), rhs, group_sizes, lhs.dtype,
                      (tm, *tiling[1:]), transpose_rhs=transpose_rhs, interpret=interpret)[:m]
    keep = jnp.arange(m) < jnp.sum(group_sizes)
    return jnp.where(keep[:, None], out, jnp.zeros((), out.dtype))


def tgmm_impl(lhs, rhs, group_sizes, *, tiling=TILING, interpret=False):
    backend = _backend()

    m = lhs.shape[0]
    tm, mp = _row_tile(m, tiling[0])
    pad = ((0, mp - m), (0, 0))
    out_dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    return backend.tgmm(jnp.pad(lhs, pad).swapaxes(0, 1), jnp.pad(rhs, pad),
                        group_sizes.astype(jnp.int32), out_dtype, (tm, *tiling[1:]),
                        interpret=interpret)


def make_gmm(tiling=TILING, interpret: bool = False):
    """A differentiable megablox grouped matmul; `interpret=True` runs it on CPU for tests."""
    return differentiable_gmm(
        functools.partial(gmm_impl, tiling=tiling, interpret=interpret),
        functools.partial(tgmm_impl, tiling=tiling, interpret=interpret))


gmm = make_gmm()

"""Grouped matmul through `tokamax.ragged_dot` (optional extra `tokamax`).

tokamax picks the best implementation it has for the platform (Mosaic or Triton kernels on
accelerators, XLA's `ragged_dot` elsewhere) and is differentiable by itself. Its autotuning
is left to accelerator hosts (`tokamax.autotune`); on CPU it runs XLA and is tested there
against the "cpu" backend.
"""
from __future__ import annotations

import importlib

import jax.numpy as jnp


def _tokamax():
    tokamax = importlib.import_module("tokamax")
    # tokamax reads its settings from absl flags, which would otherwise parse the host
    # program's own command line (pytest's, a CLI's) on first use and fail on its options
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return tokamax


def gmm(lhs, rhs, group_sizes, transpose_rhs=False):
    """`gmm(lhs [M, K], rhs [G, K, N] (or [G, N, K] if transpose_rhs), sizes [G]) -> [M, N]`."""
    tokamax = _tokamax()
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    out = tokamax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                             preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)

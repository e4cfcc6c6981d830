"""Grouped matmul `gmm(lhs, rhs, group_sizes)` with one backend per platform.

Rows of `lhs [M, K]` are sorted by group: the first `group_sizes[0]` rows use `rhs[0]`, the
next `group_sizes[1]` rows `rhs[1]`, and so on; rows past `sum(group_sizes)` give zeros.
Every backend is exact (same products as the dense reference) and differentiable:

=================  =============================================================
"cpu"              expert loop over dense row blocks (`gmm_cpu`), the CPU default
"pallas_gpu"       Pallas/Triton kernels with a custom VJP, the GPU default
"megablox_tpu"     JAX's megablox Pallas kernels, the TPU default
"ragged_dot"       `jax.lax.ragged_dot` (XLA; dense masked work on CPU)
"dense"            reference: every row against every group's weights, masked
=================  =============================================================

`"auto"` picks by `jax.default_backend()`.
"""
from __future__ import annotations

from typing import Callable, Literal

import jax
import jax.numpy as jnp

Backend = Literal["auto", "cpu", "pallas_gpu", "megablox_tpu", "ragged_dot", "dense"]
BACKENDS = ("cpu", "pallas_gpu", "megablox_tpu", "ragged_dot", "dense")
_AUTO = {"cpu": "cpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu",
         "tpu": "megablox_tpu"}


def resolve_backend(backend: str = "auto") -> str:
    """The concrete backend name `"auto"` stands for on this platform."""
    if backend == "auto":
        return _AUTO.get(jax.default_backend(), "ragged_dot")
    if backend not in BACKENDS:
        raise ValueError(f"unknown gmm backend {backend!r}; choose one of {('auto',) + BACKENDS}")
    return backend


def gmm_dense(lhs, rhs, group_sizes, transpose_rhs=False):
    """Reference: each row times every group's weights, keeping its own group's product."""
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    row_group = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right")
    onehot = (row_group[:, None] == jnp.arange(rhs.shape[0])[None, :]).astype(jnp.float32)
    every = jnp.einsum("mk,gkn->mgn", lhs, rhs, preferred_element_type=jnp.float32)
    return jnp.einsum("mgn,mg->mn", every, onehot).astype(lhs.dtype)


def gmm_ragged_dot(lhs, rhs, group_sizes, transpose_rhs=False):
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                             preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


def get_gmm(backend: str | Callable = "auto") -> Callable:
    """`fn(lhs, rhs, group_sizes, transpose_rhs=False) -> [M, N]` for a backend name.

    A callable is returned as is (e.g. `gmm_pallas_gpu.make_gmm(interpret=True)` in tests).
    """
    if callable(backend):
        return backend
    backend = resolve_backend(backend)
    if backend == "cpu":
        from cmoe_jax.moe.gmm.cpu import gmm as fn
    elif backend == "pallas_gpu":
        from cmoe_jax.moe.gmm.pallas_gpu import gmm as fn
    elif backend == "megablox_tpu":
        from cmoe_jax.moe.gmm.tpu import gmm as fn
    elif backend == "ragged_dot":
        fn = gmm_ragged_dot
    else:
        fn = gmm_dense
    return fn


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, backend: str = "auto",
        transpose_rhs: bool = False) -> jax.Array:
    """Grouped matmul: `lhs [M, K]`, `rhs [G, K, N]`, `group_sizes [G]` int -> `[M, N]`."""
    return get_gmm(backend)(lhs, rhs, group_sizes, transpose_rhs)

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
"tokamax"          `tokamax.ragged_dot` (optional extra: Mosaic/Triton/XLA, its own choice)
=================  =============================================================

`resolve_backend` is the one place that chooses: `"auto"` takes the first available backend
of the platform's chain (`CHAINS`), and a named backend this platform cannot run (a GPU
kernel on CPU, tokamax not installed) falls back along the same chain with a
`BackendFallbackWarning` instead of failing at the first call.
"""
from __future__ import annotations

import functools
import importlib.util
import warnings
from typing import Callable, Literal

import jax
import jax.numpy as jnp

Backend = Literal["auto", "cpu", "pallas_gpu", "megablox_tpu", "ragged_dot", "dense", "tokamax"]
BACKENDS = ("cpu", "pallas_gpu", "megablox_tpu", "ragged_dot", "dense", "tokamax")
_GPU = ("gpu", "cuda", "rocm")
CHAINS = {**{p: ("pallas_gpu", "tokamax", "ragged_dot") for p in _GPU},
          "tpu": ("megablox_tpu", "tokamax", "ragged_dot"), "cpu": ("cpu", "ragged_dot")}


class BackendFallbackWarning(UserWarning):
    """The grouped-matmul backend asked for cannot run here; another one is used."""


def unavailable(backend: str, platform: str) -> str | None:
    """Why `backend` cannot run on `platform` (None: it can)."""
    if backend == "pallas_gpu" and platform not in _GPU:
        return f"needs a GPU (Triton kernels), this platform is {platform}"
    if backend == "megablox_tpu" and platform != "tpu":
        return f"needs a TPU, this platform is {platform}"
    if backend == "tokamax" and importlib.util.find_spec("tokamax") is None:
        return "tokamax is not installed (pip install 'cmoe_jax[tokamax]')"
    return None


@functools.cache
def _resolve(backend: str, platform: str) -> str:
    chain = CHAINS.get(platform, ("ragged_dot",))
    if backend != "auto":
        chain = (backend,) + tuple(b for b in chain if b != backend)
    for name in chain:
        if unavailable(name, platform) is None:
            if backend not in ("auto", name):
                warnings.warn(f"gmm backend {backend!r} {unavailable(backend, platform)}: using "
                              f"{name!r}", BackendFallbackWarning, stacklevel=4)
            return name
    return "dense"  # pragma: no cover - ragged_dot runs everywhere


def resolve_backend(backend: str = "auto") -> str:
    """The concrete backend that runs for `backend` on this platform (module docstring)."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown gmm backend {backend!r}; choose one of {('auto',) + BACKENDS}")
    return _resolve(backend, jax.default_backend())


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
    elif backend == "tokamax":
        from cmoe_jax.moe.gmm.tokamax_gmm import gmm as fn
    elif backend == "ragged_dot":
        fn = gmm_ragged_dot
    else:
        fn = gmm_dense
    return fn


def get_glu(backend: str | Callable = "auto") -> Callable | None:
    """The backend's fused `glu(x, src, w_gate, w_up, group_sizes, activation)` (gather the
    rows `x[src]`, both projections and the activation in one pass), or None where the
    backend has none (the dispatch then runs the grouped matmuls one by one)."""
    if callable(backend) or resolve_backend(backend) != "cpu":
        return None
    from cmoe_jax.moe.gmm.cpu import glu
    return glu


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, backend: str = "auto",
        transpose_rhs: bool = False) -> jax.Array:
    """Grouped matmul: `lhs [M, K]`, `rhs [G, K, N]`, `group_sizes [G]` int -> `[M, N]`."""
    return get_gmm(backend)(lhs, rhs, group_sizes, transpose_rhs)

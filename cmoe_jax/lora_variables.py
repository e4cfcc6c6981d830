"""LoRA adapters as variables of the modules they adapt.

A weight `W [in, out]` named `name` of a module is adapted by two `LoRA` variables on the
same module, `<name>_lora_a [in, r]` and `<name>_lora_b [r, out]` (stacked experts
`W [E, in, out]`: `[E, in, r]` and `[E, r, out]`); the projection becomes
`x @ W + scale * drop(x) @ A @ B`. `LoRA` is its own `nnx.Variable` type, so
`nnx.split(model, LoRA, ...)` separates the adapters from the frozen weights, and the
modules' one forward serves evaluation, conversion and training alike: a module without
adapters computes exactly `x @ W`. The factors are float32; `scale` and the dropout rate
are static attributes of the adapted module.
"""
from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
from flax import nnx

SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"


class LoRA(nnx.Variable):
    """A low-rank adapter factor (trainable; kept apart from the frozen weights by type)."""


def attach(module: nnx.Module, name: str, a, b, scale: float, dropout: float = 0.0) -> None:
    """Give `module`'s weight `name` the adapter factors `a`, `b` (in place)."""
    setattr(module, name + SUFFIX_A, LoRA(jnp.asarray(a, jnp.float32)))
    setattr(module, name + SUFFIX_B, LoRA(jnp.asarray(b, jnp.float32)))
    module.lora_scale, module.lora_dropout = float(scale), float(dropout)


def factors(module: nnx.Module, name: str):
    """(A, B) arrays of the adapter of weight `name`, or None when it has none."""
    a = getattr(module, name + SUFFIX_A, None)
    return None if a is None else (a[...], getattr(module, name + SUFFIX_B)[...])


def adapter_axes(name: str, declared: dict) -> tuple | None:
    """Logical axes of an adapter variable, from its weight's: A keeps the input axes, B the
    output axis; the rank axis is never split. None when `name` is not an adapter."""
    for suffix in (SUFFIX_A, SUFFIX_B):
        weight = declared.get(name[: -len(suffix)]) if name.endswith(suffix) else None
        if weight is not None:
            return (*weight[:-1], None) if suffix == SUFFIX_A else (*weight[:-2], None, weight[-1])
    return None


def _dropout(module, name: str, x, key):
    rate = getattr(module, "lora_dropout", 0.0)
    if rate == 0.0 or key is None:
        return x
    # one mask per adapted weight, from the caller's key and the weight's name
    k = jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)
    keep = jax.random.bernoulli(k, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype))


def project(module: nnx.Module, name: str, x: jax.Array, w: jax.Array, key=None) -> jax.Array:
    """`x @ w`, plus `scale * drop(x) @ A @ B` when weight `name` has an adapter. Products
    accumulate in float32 (in bf16 on CPU a plain bf16 dot is about 1.5x slower)."""
    y = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.result_type(x, w))
    ab = factors(module, name)
    if ab is None:
        return y
    low = (_dropout(module, name, x, key).astype(jnp.float32) @ ab[0]) @ ab[1]
    return y + (module.lora_scale * low).astype(y.dtype)


def grouped_delta(module: nnx.Module, name: str, rows, group_sizes, gmm, key=None, ab=None):
    """The low-rank update of stacked expert weight `name` for rows sorted by expert (through
    the same grouped matmuls as the weights), or None when it has no adapter. `ab`: the
    factors to use instead of the module's (a device's share of them, expert-parallel)."""
    ab = factors(module, name) if ab is None else ab
    if ab is None:
        return None
    rows = _dropout(module, name, rows, key).astype(jnp.float32)
    return module.lora_scale * gmm(gmm(rows, ab[0], group_sizes), ab[1], group_sizes)

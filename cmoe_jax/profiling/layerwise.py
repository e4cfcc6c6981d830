"""Layer-by-layer calibration passes, jit-compiled and data-parallel over local devices.

The calibration batch [N, T, d] is sharded over the "data" axis of a mesh; parameters are
replicated. Each step is a pure function of (graphdef, state, activations), compiled once per
distinct layer structure, so all layers of a model share one compilation.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cmoe_jax.errors import CmoeError
from cmoe_jax.sharding import ShardingError, batch_axes, make_mesh


class NonFiniteActivations(CmoeError):
    """NaN or inf reached a layer's FFN input during a calibration pass."""


def calibration_mesh(num_windows: int, devices=None, expert: int = 1) -> Mesh:
    """A ("data"[, "expert"]) mesh over the most local devices whose data x expert count
    divides the batch; `expert > 1` splits the converted layers' routed experts over that
    many devices (expert parallelism, `cmoe_jax.moe.expert_parallel`)."""
    devices = list(jax.local_devices() if devices is None else devices)
    if expert < 1 or len(devices) % expert:
        raise ShardingError(f"--expert-parallel {expert} must divide the {len(devices)} local devices")
    if num_windows % expert:
        raise ShardingError(f"--calib-samples {num_windows} must be a multiple of "
                            f"--expert-parallel {expert} (the batch is split over the expert axis too)")
    n = max(d for d in range(1, len(devices) // expert + 1) if num_windows % (d * expert) == 0)
    return make_mesh(n, expert=expert, devices=devices)


def shard_batch(x, mesh: Mesh):
    return jax.device_put(x, NamedSharding(mesh, P(batch_axes(mesh))))


def replicate(tree, mesh: Mesh):
    return jax.device_put(tree, NamedSharding(mesh, P()))


@functools.partial(jax.jit, static_argnums=0)
def embed_step(graphdef, state, tokens):
    return nnx.merge(graphdef, state).embed_tokens(tokens)


@functools.partial(jax.jit, static_argnums=0)
def attention_step(graphdef, state, h, rope):
    """Residual stream after attention, the FFN input (post-attention RMSNorm) and whether
    that input is all finite (checked in the same pass rather than a second sweep over it)."""
    layer = nnx.merge(graphdef, state)
    h_mid = layer.attention_block(h, rope)
    x = layer.ffn_input(h_mid)
    return h_mid, x, jnp.isfinite(x).all()


@functools.partial(jax.jit, static_argnums=0)
def ffn_residual_step(graphdef, state, h_mid, x):
    """h_mid + FFN(x) for a (converted) FFN module, plus its per-expert load if it has one."""
    from cmoe_jax.moe import MoEFFN

    ffn = nnx.merge(graphdef, state)
    if isinstance(ffn, MoEFFN):
        y, load = ffn(x, return_load=True)
    else:
        y, load = ffn(x), jnp.zeros((0,), jnp.int32)
    return h_mid + y, load



def start_pass(model, tokens, mesh: Mesh):
    """(residual stream after the embedding [N, T, d], RoPE tables) on `mesh`: the start of a
    layer-by-layer pass over the calibration windows `tokens [N, T]`."""
    graphdef, state = nnx.split(model)
    h = embed_step(graphdef, replicate(state, mesh), shard_batch(tokens, mesh))
    return h, replicate(model.rope(tokens.shape[1]), mesh)


def layer_ffn_input(layer, index: int, h, rope, mesh: Mesh):
    """(residual after attention, FFN input, seconds) of decoder layer `index`; non-finite
    FFN inputs stop the pass with one clear error."""
    import time

    t0 = time.perf_counter()
    lg, ls = nnx.split(layer)
    h_mid, x, finite = attention_step(lg, replicate(ls, mesh), h, rope)
    if not finite:
        raise NonFiniteActivations(f"layer {index}: NaN or inf in the FFN input activations; check "
                                   "the weights and use float32 for conversion")
    return h_mid, x, time.perf_counter() - t0

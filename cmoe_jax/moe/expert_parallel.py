"""Expert parallelism: routed experts under `jax.shard_map`, tokens exchanged by all-to-all.

The experts' weights are split over the mesh axis `expert_axis` (E / n experts per device),
the tokens over every mesh axis. Each device

1. sorts its (token, slot) pairs by expert and writes them into one buffer per destination
   device (the device holding that expert),
2. exchanges the buffers with `jax.lax.all_to_all` over `expert_axis`,
3. sorts what it received by local expert and runs its experts (`apply`, e.g. the SwiGLU
   of three grouped matmuls) on those rows only,
4. sends the results back with a second all-to-all and combines each token's k outputs
   with its gates.

Capacity-free: every buffer has room for all of a device's pairs (the worst case, all of
them routed to one device), so no token is ever dropped; the unused rows are zeros, which
the grouped matmuls skip (rows past the group sizes). XLA:CPU has no `ragged_all_to_all`
in jax 0.10.2, hence the padded all-to-all. The load counts are summed over all devices
(`psum`), so the balancing bias update sees the global load. The token activations are
never gathered: a device only ever holds its own tokens and the rows sent to its experts.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from cmoe_jax.moe.dispatch import GLUExperts, combine, expert_swiglu, plan, routed_experts
from cmoe_jax.moe.modes import DEFAULT_EXPERT_AXIS, expert_axis_size, expert_parallel_active

__all__ = ["DEFAULT_EXPERT_AXIS", "expert_axis_size", "routed_experts_sharded",
           "routed_swiglu_experts", "tokens_sharded"]


def _exchange(x, expert_ids, gates, params, apply, axis, tokens_axes):
    """Per-device body: see the module docstring. Shapes are the local blocks."""
    n_dev = jax.lax.axis_size(axis)
    local_experts = jax.tree.leaves(params)[0].shape[0]
    num_tokens, top_k = expert_ids.shape
    pairs = num_tokens * top_k
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)
    sorted_ids = flat[order]
    dest = sorted_ids // local_experts
    per_dest = jnp.bincount(dest, length=n_dev)
    pos = jnp.arange(pairs, dtype=jnp.int32) - (jnp.cumsum(per_dest) - per_dest)[dest]

    send = jnp.zeros((n_dev, pairs, x.shape[1]), x.dtype).at[dest, pos].set(x[order // top_k])
    # local expert id of every buffer row; `local_experts` marks an empty row (sorted last)
    send_ids = jnp.full((n_dev, pairs), local_experts, jnp.int32).at[dest, pos].set(
        sorted_ids % local_experts)
    recv = jax.lax.all_to_all(send, axis, 0, 0)
    recv_ids = jax.lax.all_to_all(send_ids, axis, 0, 0)

    d = plan(recv_ids.reshape(-1, 1), local_experts + 1)
    ys = apply(recv.reshape(n_dev * pairs, -1)[d.order], d.group_sizes[:local_experts], params)
    back = jax.lax.all_to_all(ys[d.inverse].reshape(n_dev, pairs, -1), axis, 0, 0)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(pairs, dtype=order.dtype))
    out = combine(back[dest, pos][inverse], gates)
    counts = jax.lax.psum(jnp.bincount(flat, length=local_experts * n_dev), tokens_axes)
    return out, counts.astype(jnp.int32)


def _token_split(mesh, num_tokens: int) -> P:
    if num_tokens % mesh.size:
        raise ValueError(f"{num_tokens} tokens do not split over {mesh.size} devices; "
                         f"pad the batch to a multiple of {mesh.size}")
    return P(tuple(mesh.axis_names))


def tokens_sharded(fn: Callable, x: jax.Array, params: Any, mesh=None):
    """`fn(x, params)` on each device's tokens (`x [T, ...]` split over every mesh axis,
    `params` replicated); the outputs keep the token split."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    tok = _token_split(mesh, x.shape[0])
    return jax.shard_map(fn, mesh=mesh, in_specs=(tok, P()), out_specs=tok)(x, params)


def routed_experts_sharded(x: jax.Array, expert_ids: jax.Array, gates: jax.Array, params: Any,
                           apply: Callable, *, expert_axis: str = DEFAULT_EXPERT_AXIS,
                           mesh=None) -> tuple[jax.Array, jax.Array]:
    """`routed_experts` with the experts split over `expert_axis` of `mesh`.

    `x [T, d]`, `expert_ids`/`gates [T, k]`; `params` a pytree of arrays with the expert
    axis first (`[E, ...]`), `apply(rows, group_sizes, local_params) -> [rows, d_out]` runs
    a device's experts on its rows sorted by expert. `mesh`: default the one set with
    `jax.set_mesh`. T must divide by the number of devices, E by the `expert_axis` size.
    Returns float32 `[T, d_out]` and the global int32 `[E]` load counts.
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    tok = _token_split(mesh, x.shape[0])
    n_exp = expert_axis_size(expert_axis, mesh)
    num_experts = jax.tree.leaves(params)[0].shape[0]
    if num_experts % n_exp:
        raise ValueError(f"{num_experts} experts do not split over {n_exp} devices of "
                         f"mesh axis {expert_axis!r}")

    def body(x, ids, gates, params):
        return _exchange(x, ids, gates, params, apply, expert_axis, tuple(mesh.axis_names))

    fn = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, P(expert_axis)),
                       out_specs=(tok, P()))
    return fn(x, expert_ids, gates, params)


def routed_swiglu_experts(x: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                          experts: GLUExperts, *, expert_axis: str | None = DEFAULT_EXPERT_AXIS,
                          adapters: dict | None = None, make_lora: Callable | None = None,
                          expert_parallel: bool | None = None):
    """The routed GLU `experts`, expert-parallel when the mesh set with `jax.set_mesh` has
    `expert_axis` (size > 1), else the one-device dispatch (`expert_parallel`: that decision
    when the caller already made it, `cmoe_jax.moe.modes`).

    `adapters`, optional: a pytree of per-expert arrays (expert axis first, e.g. stacked LoRA
    factors), split over the devices like the weights; `make_lora(adapters)` turns a
    device's share into the `lora(name, rows, group_sizes)` hook of `GLUExperts` (it replaces
    `experts.lora`).
    """
    def on(weights, ad) -> GLUExperts:
        lora = make_lora(ad) if make_lora is not None and ad else None
        return dataclasses.replace(experts, w_gate=weights[0], w_up=weights[1], w_down=weights[2],
                                   lora=lora)

    if expert_parallel is None:
        expert_parallel = expert_parallel_active(expert_axis, experts.w_gate)
    if not expert_parallel:
        return routed_experts(x, expert_ids, gates, on(experts.weights, adapters))

    def apply(rows, sizes, params):
        return expert_swiglu(rows, sizes, on(*params))

    return routed_experts_sharded(x, expert_ids, gates, (experts.weights, adapters or {}), apply,
                                  expert_axis=expert_axis)

"""Expert parallelism: routed experts under `jax.shard_map`, tokens exchanged all-to-all.

The experts' weights are split over the mesh axis `expert_axis` (E / n experts per device),
the tokens over every mesh axis. Each device

1. sorts its (token, slot) pairs by expert, which groups them by destination device (the
   device holding that expert); dropped pairs (`cmoe_jax.moe.token_pairs`) sort last and
   go nowhere;
2. sends each device exactly its rows (`ragged_exchange`), after one all-gather of the
   `[n, n]` send counts tells every device where its rows land;
3. sorts what it received by local expert and runs its experts (`apply`, e.g. the SwiGLU
   of three grouped matmuls) on those rows only;
4. sends the results back the same way and combines each token's k outputs with its gates.

On GPU and TPU the exchange is `jax.lax.ragged_all_to_all` (only the rows sent travel);
XLA:CPU has none, so there the same exchange runs as a padded `all_to_all` of one
fixed-size block per device pair (`padded_ragged_all_to_all`, exact, chosen per platform
with `jax.lax.platform_dependent`). The receive buffer has room for the worst case (every
pair of every device sent to one device; with a capacity factor, each expert's capacity),
so no token is dropped that capacity did not drop. The load counts are summed over all
devices (`psum`), so the balancing bias update sees the global load. The token activations
are never gathered: a device only ever holds its own tokens and the rows sent to its experts.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from cmoe_jax.moe.dispatch import GLUExperts, combine, expert_swiglu, plan, routed_experts
from cmoe_jax.moe.mesh_axes import DEFAULT_EXPERT_AXIS, expert_axis_size, expert_parallel_active, token_split

__all__ = ["padded_ragged_all_to_all", "ragged_exchange", "routed_experts_sharded", "routed_swiglu_experts"]


def _exclusive_cumsum(a, axis=0):
    return jnp.cumsum(a, axis=axis) - a


def padded_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                             recv_sizes, *, axis_name, block: int):
    """`jax.lax.ragged_all_to_all` (one slice per device) as a padded `all_to_all`: each
    slice travels in a `block`-row buffer (`block` >= every send size), then lands at its
    offset in `output`."""
    rows = jnp.arange(block, dtype=jnp.int32)
    src = input_offsets[:, None] + rows
    sent = (rows < send_sizes[:, None]).reshape(src.shape + (1,) * (operand.ndim - 1))
    send = jnp.where(sent, operand[jnp.minimum(src, operand.shape[0] - 1)], jnp.zeros((), operand.dtype))
    recv = jax.lax.all_to_all(send, axis_name, 0, 0)                    # [n, block, ...]
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)[:, None] + rows
    at = jnp.where(rows < recv_sizes[:, None], at, output.shape[0])     # past the end: dropped
    return output.at[at.reshape(-1)].set(recv.reshape((-1,) + recv.shape[2:]), mode="drop")


def ragged_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                    *, axis_name, block: int):
    """`ragged_all_to_all` where the platform has it (GPU, TPU), else its padded form."""
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    ragged = lambda *a: jax.lax.ragged_all_to_all(*a, axis_name=axis_name)  # noqa: E731
    padded = lambda *a: padded_ragged_all_to_all(*a, axis_name=axis_name, block=block)  # noqa: E731
    return jax.lax.platform_dependent(*args, cpu=padded, default=ragged)


def _exchange(x, expert_ids, gates, params, apply, axis, tokens_axes, block=None):
    """Per-device body: see the module docstring. Shapes are the local blocks; `block`: the
    most rows one device sends another (default all its pairs)."""
    n_dev, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    local_experts = jax.tree.leaves(params)[0].shape[0]
    num_tokens, top_k = expert_ids.shape
    block = num_tokens * top_k if block is None else block
    d = plan(expert_ids, local_experts * n_dev)          # dropped pairs (id E) sort last
    sorted_ids = expert_ids.reshape(-1)[d.order]
    send_sizes = jnp.bincount(sorted_ids // local_experts, length=n_dev).astype(jnp.int32)
    sizes = jax.lax.all_gather(send_sizes, axis)         # [source, destination]
    send_offsets = _exclusive_cumsum(send_sizes)
    recv_sizes, recv_offsets = sizes[:, me], _exclusive_cumsum(sizes[:, me])
    lands_at = _exclusive_cumsum(sizes, axis=0)[me]      # my slice's offset on each receiver
    varying = lambda a: jax.lax.pcast(a, tuple(tokens_axes), to="varying")  # noqa: E731

    def there(rows, fill):
        out = varying(jnp.full((n_dev * block,) + rows.shape[1:], fill, rows.dtype))
        return ragged_exchange(rows, out, send_offsets, send_sizes, lands_at, recv_sizes,
                               axis_name=axis, block=block)

    with jax.named_scope("dispatch"):
        recv = there(x[d.order // top_k], 0)
        recv_ids = there(sorted_ids % local_experts, local_experts)  # empty rows: past every expert
    r = plan(recv_ids[:, None], local_experts)
    ys = apply(recv[r.order], r.group_sizes, params)[r.inverse]
    with jax.named_scope("dispatch"):  # back again: my received slices to their senders
        back_at = _exclusive_cumsum(sizes, axis=1)[:, me]
        back = ragged_exchange(ys, varying(jnp.zeros((num_tokens * top_k,) + ys.shape[1:], ys.dtype)),
                               recv_offsets, recv_sizes, back_at, send_sizes, axis_name=axis, block=block)
    out = combine(back, gates, d.inverse)
    counts = jax.lax.psum(d.group_sizes, tokens_axes)
    return out, counts.astype(jnp.int32)


def routed_experts_sharded(x: jax.Array, expert_ids: jax.Array, gates: jax.Array, params: Any,
                           apply: Callable, *, expert_axis: str = DEFAULT_EXPERT_AXIS,
                           mesh=None, expert_capacity: int | None = None) -> tuple[jax.Array, jax.Array]:
    """`routed_experts` with the experts split over `expert_axis` of `mesh`.

    `x [T, d]`, `expert_ids`/`gates [T, k]`; `params` a pytree of arrays with the expert
    axis first (`[E, ...]`), `apply(rows, group_sizes, local_params) -> [rows, d_out]` runs
    a device's experts on its rows sorted by expert. `mesh`: default the one set with
    `jax.set_mesh`. T must divide by the number of devices (`MoEFFN` pads), E by the
    `expert_axis` size. Pairs with expert id E are dropped (`cmoe_jax.moe.token_pairs`);
    `expert_capacity`: the most pairs of one device's tokens an expert runs (a capacity
    factor's), which bounds the exchange buffers. Returns float32 `[T, d_out]` and the
    global int32 `[E]` load counts.
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    tok = token_split(mesh, x.shape[0])
    n_exp = expert_axis_size(expert_axis, mesh)
    num_experts = jax.tree.leaves(params)[0].shape[0]
    if num_experts % n_exp:
        raise ValueError(f"{num_experts} experts do not split over {n_exp} devices of "
                         f"mesh axis {expert_axis!r}")

    local_pairs = expert_ids.size // mesh.size
    block = local_pairs if expert_capacity is None else min(local_pairs, expert_capacity * (num_experts // n_exp))

    def body(x, ids, gates, params):
        return _exchange(x, ids, gates, params, apply, expert_axis, tuple(mesh.axis_names), block)

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
                                  expert_axis=expert_axis, expert_capacity=experts.capacity)

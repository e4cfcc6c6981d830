"""How an MoE layer creates its variables: every weight matrix drawn like the checkpoints
were made (or by a user's initializer), each variable carrying its logical axes as Flax
partitioning metadata (`out_sharding`, read by `cmoe_jax.sharding` and
`nnx.get_partition_spec`; never placed eagerly: the mesh rules decide that)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from cmoe_jax.moe.balance import RouterBias, RouterThreshold

_init = nnx.initializers.normal(0.02)

Axes = tuple  # logical axis names, one per dimension (`cmoe_jax.sharding.RULES`)


def with_axes(axes: Axes) -> dict:
    """The metadata of a variable whose dimensions have the logical `axes`."""
    return {"out_sharding": tuple(axes), "eager_sharding": False}


def axes_of(var: nnx.Variable) -> Axes | None:
    """The logical axes a variable was created with (None: none declared)."""
    return var.get_metadata().get("out_sharding")


def like(var: nnx.Variable, value) -> nnx.Variable:
    """A new variable of `var`'s type and logical axes holding `value` (replacing a layer's
    variable keeps its structure, so stacked layers still match)."""
    axes = axes_of(var)
    return type(var)(value, **({} if axes is None else with_axes(axes)))


def make_param(rngs: nnx.Rngs, dtype, kernel_init=None):
    """`param(*shape, axes=...) -> nnx.Param`: the default init draws the whole tensor at once
    (as checkpoints were made with); a user's `kernel_init` sees 2-D `[in, out]` matrices,
    one call per stacked expert, so fan-in scaled inits (lecun, he) get the right fans."""
    def param(*shape, axes: Axes):
        key = rngs.params()
        if kernel_init is None:
            value = _init(key, shape, dtype)
        elif len(shape) == 2:
            value = kernel_init(key, shape, dtype)
        else:
            keys = jax.random.split(key, shape[0])
            value = jax.vmap(lambda k: kernel_init(k, shape[1:], dtype))(keys)
        return nnx.Param(value, **with_axes(axes))
    return param


def make_router_params(layer, params: dict, param, param_dtype, top_level: bool = False) -> None:
    """Create a router's arrays (`Router.params`) on `layer`, in declaration order."""
    for p in params.values():
        if p.init == "zeros":
            value = nnx.Param(jnp.zeros(p.shape, param_dtype), **with_axes(p.axes))
        elif p.init == "bias":
            value = RouterBias(jnp.zeros(p.shape, jnp.float32), **with_axes(p.axes))
        elif p.init == "fixed":
            value = RouterThreshold(jnp.zeros(p.shape, jnp.float32), **with_axes(p.axes))
        else:
            value = param(*p.shape, axes=p.axes)
        setattr(layer, p.attr(top_level), value)

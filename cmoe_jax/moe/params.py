"""How an MoE layer creates its parameters: every weight matrix drawn like the checkpoints
were made (or by a user's initializer), a router's arrays as its unit declares them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from cmoe_jax.moe.balance import RouterBias

_init = nnx.initializers.normal(0.02)


def make_param(rngs: nnx.Rngs, dtype, kernel_init=None):
    """`param(*shape) -> nnx.Param`: the default init draws the whole tensor at once (as
    checkpoints were made with); a user's `kernel_init` sees 2-D `[in, out]` matrices, one
    call per stacked expert, so fan-in scaled inits (lecun, he) get the right fans."""
    def param(*shape):
        key = rngs.params()
        if kernel_init is None:
            return nnx.Param(_init(key, shape, dtype))
        if len(shape) == 2:
            return nnx.Param(kernel_init(key, shape, dtype))
        keys = jax.random.split(key, shape[0])
        return nnx.Param(jax.vmap(lambda k: kernel_init(k, shape[1:], dtype))(keys))
    return param


def make_router_params(layer, params: dict, param, param_dtype, top_level: bool = False) -> None:
    """Create a router's arrays (`Router.params`) on `layer`, in declaration order."""
    for p in params.values():
        if p.init == "zeros":
            value = nnx.Param(jnp.zeros(p.shape, param_dtype))
        elif p.init == "bias":
            value = RouterBias(jnp.zeros(p.shape, jnp.float32))
        else:
            value = param(*p.shape)
        setattr(layer, p.attr(top_level), value)

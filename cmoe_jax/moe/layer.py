"""`MoEFFN`: a SwiGLU mixture-of-experts FFN with one router and an optional always-on shared MLP.

One module covers the three kinds of MoE FFN the project needs: the layers of sparse
checkpoints (Qwen3-MoE, Mixtral: `router="linear"`), the output of the CMoE converter
(`router="cmoe"`, shared experts fused into one shared MLP) and the dense FFN split into
experts (`router="sum"`, exact). Routed experts are stacked on a leading expert axis and run
on the path `cmoe_jax.moe.modes` picks (`cmoe_jax.moe.moe_layer` says what a call does).

Example::

    import jax.numpy as jnp
    from flax import nnx
    from cmoe_jax.moe import MoEFFN

    layer = MoEFFN(d_model=64, expert_width=32, num_experts=8, top_k=2, shared_width=32,
                   router="cmoe", activation="silu", rngs=nnx.Rngs(0))
    y, counts = layer(jnp.ones((4, 16, 64)), return_load=True)   # counts: int32 [8]
    layer.update_bias(counts, gamma=1e-3)                        # load balancing step
    y, r = layer(jnp.ones((4, 16, 64)), return_router=True)      # r: `RouterOutput`

A guide with every argument, the routers, backends and expert parallelism:
docs/guides/moe-layer.md.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from cmoe_jax.moe.balance import update_router_bias
from cmoe_jax.moe.checks import check_input
from cmoe_jax.moe.mesh_axes import tokens_sharded
from cmoe_jax.moe.moe_layer import MoELayer, RoutedPairs
from cmoe_jax.moe.params import make_router_params, with_axes
from cmoe_jax.moe.prototypes import TABLE_NAMES, SlotMap, to_prototypes
from cmoe_jax.moe.routers import router_logits
from cmoe_jax.moe.routers.base import jittered
from cmoe_jax.moe.token_pairs import load_of


class MoEFFN(MoELayer):
    """MoE FFN: `shared(x) + sum_{e in top_k(x)} g_e(x) * expert_e(x)`, x `[..., d_model]`.

    Built from one `FFNSpec` (`spec`, passed whole, as models build their layers) or from its
    fields given as keywords (`MoEFFN(d_model=64, expert_width=32, num_experts=8, top_k=2,
    activation="silu", rngs=...)`); keywords given with a spec replace its fields. The
    layer's own settings (`d_model`, `activation`, `dtype`, `param_dtype`, `backend`,
    `expert_axis`, `kernel_init`, `dispatch`, `sow_router`) are `MoELayer`'s.

    Parameters (JAX layout, `[in, out]`, each with its logical axes as partitioning
    metadata): `shared_gate/shared_up [d, S]`, `shared_down [S, d]`; `expert_gate/expert_up
    [E, d, m]`, `expert_down [E, m, d]`; the router's arrays as its kind declares them
    (`cmoe_jax.moe.routers`: linear `router_kernel [d, E]`; cmoe `router_gate/router_up
    [d, E*r]`, `u [E]` and the balancing bias `router_bias [E]`, a `RouterBias`). With
    `num_prototypes` K > 0 the experts hold K prototypes behind an int32 `slot_map [E]`;
    with `skip_compensation`, `skip_down [E*r, d]` (`cmoe_jax.moe.skip_term`).
    """

    TABLE_NAMES = TABLE_NAMES  # what a cross-layer ConMoE scope shares

    def build(self, spec, param) -> None:
        d, m, e = self.d_model, spec.expert_width, spec.num_experts
        self.router_unit.validate(self.router_settings)
        if spec.num_prototypes > 0:  # ConMoE: K stored prototypes behind the E router slots
            self.slot_map = SlotMap(jnp.arange(e, dtype=jnp.int32) % spec.num_prototypes, **with_axes(("router",)))
            e = spec.num_prototypes
        self.expert_gate = param(e, d, m, axes=("expert", "embed", "mlp"))
        self.expert_up = param(e, d, m, axes=("expert", "embed", "mlp"))
        self.expert_down = param(e, m, d, axes=("expert", "mlp", "embed"))
        make_router_params(self, self.router_unit.params(d, self.router_settings), param, self.param_dtype)
        if spec.skip_compensation:  # zero: a fresh layer predicts nothing for its skipped experts
            rows = spec.num_experts * spec.router_neurons
            self.skip_down = nnx.Param(jnp.zeros((rows, d), self.param_dtype), **with_axes(("router", "embed")))

    num_experts = property(lambda self: self.spec.num_experts, doc="E, the router's slots")

    @property
    def top_k(self) -> int:
        """k, the experts each token uses."""
        return self.spec.top_k

    @top_k.setter
    def top_k(self, value: int) -> None:
        self.spec = dataclasses.replace(self.spec, top_k=value)

    def router_arrays(self) -> dict:
        """role -> the router's arrays (`Router.params`)."""
        return {role: getattr(self, p.name)[...]
                for role, p in self.router_unit.params(self.d_model, self.router_settings).items()}

    def route(self, x: Float[Array, "T d"], key=None) -> tuple[Int[Array, "T k"], Float[Array, "T k"]]:
        """Expert ids int32 `[T, k]` and float32 gates `[T, k]` for tokens `x [T, d]` (`key`:
        training, the router's jitter if it has one).

        Expert-parallel, each device routes its own tokens (XLA would otherwise gather the
        router scores of all tokens for the top-k)."""
        if getattr(x, "ndim", 0) != 2:
            raise ValueError(f"route expects flattened tokens [T, d_model={self.d_model}], got "
                             f"shape {getattr(x, 'shape', None)}")
        check_input(x, self.d_model, type(self).__name__)
        x, arrays = jittered(x, self.router_settings, key), self.router_arrays()
        keep = self.slot_map[...] >= 0 if self.num_prototypes > 0 else None  # pruned slots never win
        unit, settings = self.router_unit, self.router_settings

        def choose(x, arrays):
            arrays = dict(arrays)
            return unit.route(x, arrays, settings, keep=arrays.pop("keep", None))

        arrays = arrays if keep is None else dict(arrays, keep=keep)
        return tokens_sharded(choose, x, arrays) if self.expert_parallel() else choose(x, arrays)

    def route_pairs(self, x, key=None) -> RoutedPairs:
        slots, gates = self.route(x, key)
        if self.num_prototypes > 0:  # loads per router slot; the experts run the prototypes
            ids, gates = to_prototypes(slots, gates, self.slot_map[...], self.spec.duplicate_gates)
            return RoutedPairs(slots, ids, gates)
        return RoutedPairs(slots, slots, gates)

    def loads(self, pairs: RoutedPairs, keep, counts):
        return load_of(pairs.slots, keep, self.num_experts) if self.num_prototypes > 0 else counts

    def empty_load(self) -> jax.Array:
        return jnp.zeros((self.num_experts,), jnp.int32)

    def router_scores(self, x: Float[Array, "T d"]) -> Float[Array, "T E"]:
        keep = self.slot_map[...] >= 0 if self.num_prototypes > 0 else None
        return router_logits(self.router_unit, x, self.router_arrays(), self.router_settings, keep)

    def update_bias(self, counts: jax.Array, gamma: float) -> None:
        """Load balancing step in place: `b += gamma * sign(mean(counts) - counts)` (the cmoe
        router's bias, or the linear router's with `router_balance=True`)."""
        bias = self.router_unit.params(self.d_model, self.router_settings).get("bias")
        if bias is None:
            raise ValueError(f"router {self.router!r} has no balancing bias (the cmoe router has one; "
                             "the linear router with router_balance=True)")
        var = getattr(self, bias.name)
        var[...] = update_router_bias(var, counts, gamma)

"""What every MoE FFN layer does with a call's tokens, as a short composition of units:

    router     which experts each token uses, with what gate (`route_pairs`, the subclass's);
    keep       which (token, expert) pairs run: token mask and capacity (`cmoe_jax.moe.token_pairs`);
    experts    the routed experts on the path `cmoe_jax.moe.modes.run_experts` picks (its
               dispatch, expert computation and combine each under their own `jax.named_scope`);
    shared     the always-on shared MLP (`cmoe_jax.moe.shared_mlp`), added to the routed sum;
    skipped    with `skip_compensation`, the skipped experts' predicted outputs
               (`cmoe_jax.moe.skip_term`), added too.

`MoEFFN` routes with one router, `HierMoEFFN` with a top-level router and per-expert
sub-routers; both are built from one `FFNSpec` (kept whole as `spec`, every shape setting
read from it) and the layer's own run settings.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float

from cmoe_jax.lora_variables import factors, grouped_delta
from cmoe_jax.moe.checks import check_input, check_layer, check_mask
from cmoe_jax.moe.dispatch import GLUExperts
from cmoe_jax.moe.gmm import get_glu, get_gmm
from cmoe_jax.moe.mesh_axes import DEFAULT_EXPERT_AXIS, expert_parallel_active, token_devices
from cmoe_jax.moe.modes import ExpertRun, run_experts
from cmoe_jax.moe.params import make_param
from cmoe_jax.moe.router_outputs import router_output
from cmoe_jax.moe.routers import Router, Routing, get_router
from cmoe_jax.moe.shared_mlp import make_shared_mlp, shared_mlp
from cmoe_jax.moe.skip_term import skip_term
from cmoe_jax.moe.spec import FFNSpec, spec_with
from cmoe_jax.moe.token_pairs import capacity, drop_pairs, kept_pairs, pad_tokens


class RoutedPairs(NamedTuple):
    """A call's routing: the router's choice `slots [T, k]` (what the loads, losses and
    `RouterOutput` describe) and the rows the experts run, `ids`/`gates [T, k']` (the same
    pairs, or stored prototypes, or a hierarchical layer's sub-experts)."""

    slots: jax.Array
    ids: jax.Array
    gates: jax.Array


class MoELayer(nnx.Module):
    """An MoE FFN layer `shared(x) + sum of the gated routed experts`; a subclass defines
    `build` (its routed experts and router arrays), `route_pairs`, `loads` and `router_scores`.

    Args (each in full in docs/guides/moe-layer.md):
      spec: the shape and routing (`FFNSpec`); keywords that are its fields replace them.
      d_model: model width d. activation: the GLU activation of every expert and router
        neuron (required: a layer never silently gets another model's).
      dtype / param_dtype: compute and storage dtypes (routing always runs in float32).
      backend: grouped-matmul backend (`cmoe_jax.moe.gmm`; "auto" per platform) or a callable.
      expert_axis: mesh axis the experts split over under `jax.set_mesh` (None: never).
      kernel_init: `init(key, [in, out], dtype)` of every weight matrix (default normal(0.02)).
      dispatch: "auto" (`cmoe_jax.moe.modes` picks per call) or a forced one-device path.
      sow_router: sow each call's `RouterOutput` as `nnx.Intermediate` "router_outputs".
    """

    def __init__(self, spec: FFNSpec | None = None, *, d_model: int, rngs: nnx.Rngs, activation: str,
                 dtype=jnp.float32, param_dtype=jnp.float32, backend="auto",
                 expert_axis: str | None = DEFAULT_EXPERT_AXIS, kernel_init=None, sow_router: bool = False,
                 dispatch: str = "auto", **fields):
        spec = spec_with(spec, fields, type(self).__name__)
        check_layer(d_model, spec, backend, dispatch)
        self.spec = spec
        self.d_model, self.activation, self.dtype, self.param_dtype = d_model, activation, dtype, param_dtype
        self.backend, self.expert_axis, self.sow_router, self.dispatch = backend, expert_axis, sow_router, dispatch
        param = make_param(rngs, param_dtype, kernel_init)
        make_shared_mlp(self, param, d_model, spec.shared_width, spec.shared_gated)
        self.build(spec, param)

    def build(self, spec: FFNSpec, param) -> None:
        """Create the routed experts and the router's arrays (`param(*shape, axes=...)`)."""
        raise NotImplementedError

    # the shape, as the spec says it
    expert_width = property(lambda self: self.spec.expert_width, doc="m, each expert's width")
    shared_width = property(lambda self: self.spec.shared_width, doc="S, the shared MLP's width (0: none)")
    router = property(lambda self: self.spec.router, doc="the (top-level) router kind's name")
    num_prototypes = property(lambda self: self.spec.num_prototypes, doc="K stored prototypes (0: none)")

    @property
    def router_unit(self) -> Router:
        """The (top-level) router kind's unit (`cmoe_jax.moe.routers`)."""
        return get_router(self.spec.router)

    @property
    def router_settings(self) -> Routing:
        """What the (top-level) router needs besides its arrays (`Routing`), from the spec."""
        return Routing.of(self.spec, self.activation)

    def route_pairs(self, x: jax.Array, key=None) -> RoutedPairs:
        """The router's choice and the rows the experts run for tokens `x [T, d]`."""
        raise NotImplementedError

    def loads(self, pairs: RoutedPairs, keep, counts: jax.Array) -> jax.Array:
        """The loads `return_load` gives, from the experts' row counts `counts`."""
        return counts

    def empty_load(self) -> jax.Array:
        """The loads `return_load` gives for zero tokens."""
        raise NotImplementedError

    def router_scores(self, x: jax.Array) -> jax.Array:
        """float32 `[T, E]`: what the (top-level) router ranks (its logits; pruned slots -inf)."""
        raise NotImplementedError

    def reported_pairs(self, x: jax.Array, pairs) -> tuple:
        """(router slots `[T, k]`, pairs kept `[T, k]` or None) that `RouterOutput` describes."""
        return pairs

    def expert_parallel(self) -> bool:
        """Whether this call runs the routed experts split over the mesh's expert axis."""
        return expert_parallel_active(self.expert_axis, self.expert_gate.get_value())

    def shared(self, x: jax.Array, key=None) -> jax.Array:
        """The shared MLP (`cmoe_jax.moe.shared_mlp`; zeros when there is none)."""
        return shared_mlp(self, x, key)

    def __call__(self, x: Float[Array, "*tokens d"], *, mask: Bool[Array, "*tokens"] | None = None,
                 return_load: bool = False, return_router: bool = False, key=None):
        """`x [..., d_model] -> [..., d_model]` (in `dtype`); with `return_load` also the int32
        loads, with `return_router` also a `RouterOutput` (logits, probabilities, load,
        Switch and z losses, dropped share; computed only then), in that order.

        `mask` (bool `[...]`, optional): False for padding, which then runs no routed expert
        and counts in no load or loss (`cmoe_jax.moe.token_pairs`). Adapted weights
        (`cmoe_jax.lora_variables`) add their low-rank updates; `key` drives the adapters'
        dropout and the router's jitter."""
        owner = type(self).__name__
        check_input(x, self.d_model, owner)
        shape, mask = x.shape, check_mask(mask, x.shape[:-1], owner)
        x = x.reshape(-1, self.d_model).astype(self.dtype)
        tokens, keep = x.shape[0], None
        if tokens == 0:
            slots = jnp.zeros((0, self.top_k), jnp.int32)
            y, counts = jnp.zeros(shape, self.dtype), self.empty_load()
        else:  # expert-parallel, padded with masked tokens to split over the devices
            xp, mp = pad_tokens(x, mask, token_devices()) if self.expert_parallel() else (x, mask)
            slots, y, counts, keep = self.forward(xp, key, mp)
            slots, y = slots[:tokens], y[:tokens].reshape(shape)
            keep = None if keep is None else keep[:tokens]
        return layer_outputs(self, x, shape, y, counts, (slots, mask, keep), return_load, return_router)

    def forward(self, x: Float[Array, "T d"], key=None, mask: Bool[Array, "T"] | None = None):
        """Tokens `x [T, d]` (T > 0) and their `mask` -> (router slots `[T, k]`, y `[T, d]`,
        loads, the pairs that ran (None: all))."""
        factor, rows = self.spec.capacity_factor, self.expert_gate.shape[0]
        with jax.named_scope("router"):
            pairs = self.route_pairs(x, key)
        with jax.named_scope("dispatch"):
            keep = kept_pairs(pairs.ids, rows, mask, factor, per_device=self.expert_parallel())
            ids, gates = drop_pairs(pairs.ids, pairs.gates, keep, rows)
        routed, counts = self.routed_experts(x, ids, gates, key, factor)
        loads = self.loads(pairs, keep, counts)
        with jax.named_scope("shared_mlp"):
            shared = self.shared(x, key).astype(jnp.float32)
        with jax.named_scope("combine"):
            y = shared + routed
            if self.spec.skip_compensation:
                y = y + self.skipped(x, pairs.slots, mask)
            y = y.astype(self.dtype)
        return pairs.slots, y, loads, keep

    def skipped(self, x, slots, mask=None):
        """float32 `[T, d]` compensation of the experts outside `slots` (`cmoe_jax.moe.skip_term`)."""
        return skip_term(x, self.router_gate[...], self.router_up[...], self.skip_down[...], slots,
                         self.spec.num_experts, activation=self.activation, mask=mask)

    def routed_experts(self, x, ids, gates, key=None, factor: float = 0.0):
        """float32 `[T, d]` sum of the kept pairs' gated expert outputs and int32 row loads.

        LoRA factors of the experts (if any) travel with the weights, so expert-parallel each
        device applies the adapters of the experts it holds."""
        weights = tuple(p[...].astype(self.dtype) for p in (self.expert_gate, self.expert_up, self.expert_down))
        gmm = get_gmm(self.backend)
        adapters = {n: ab for n in ("gate", "up", "down") if (ab := factors(self, "expert_" + n)) is not None}

        def make_lora(ad):
            return lambda name, rows, sizes: (grouped_delta(self, "expert_" + name, rows, sizes, gmm, key,
                                                            ab=ad[name]) if name in ad else None)

        limit = (capacity(x.shape[0] // token_devices(), ids.shape[1], weights[0].shape[0], factor)
                 if factor > 0 else None)
        experts = GLUExperts(*weights, gmm, self.activation, glu=get_glu(self.backend), capacity=limit)
        run = ExpertRun(self.dtype, self.expert_axis, self.dispatch, self.expert_gate.get_value())
        return run_experts(x, ids, gates, experts, run, adapters, make_lora)


def layer_outputs(layer: MoELayer, x, shape, y, counts, pairs: tuple, return_load: bool, return_router: bool):
    """`y`, plus the loads and the router outputs asked for (computed only then)."""
    router = None
    if return_router or layer.sow_router:
        slots, mask, keep = pairs
        scores = layer.router_scores(x)
        slots, keep = layer.reported_pairs(x, (slots, keep))
        router = router_output(scores, slots, shape[:-1], mask=mask, keep=keep)
        if layer.sow_router:
            layer.sow(nnx.Intermediate, "router_outputs", router)
    out = (y,) + ((counts,) if return_load else ()) + ((router,) if return_router else ())
    return out[0] if len(out) == 1 else out

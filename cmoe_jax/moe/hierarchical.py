"""`HierMoEFFN`: an MoE layer whose experts are each carved into shared and routed sub-experts
(hierarchical CMoE, paper 001 section 4.4, Eq. 10):

    y = shared_host(x) + sum_{i in TopK(x)} w_i(x) [ E_i^s(x) + sum_{j in TopN'_k(s'_i + b_i)} g'_ij E_ij^r(x) ]

The top-level router (a checkpoint's "linear" router, or a converted model's "cmoe" one) is
the source layer's, unchanged. Expert i's sub-experts are rows `i*N' .. i*N'+N'-1` of one
stacked `[N*N', d, m']` tensor: its N'_s shared sub-experts first (always on when i is
selected), then its N'_r routed ones. Its sub-router is the representative-neuron router of
its routed sub-experts (`sub_gate/sub_up [N, d, N'_r*r]`), with trainable scales
`u [N, N'_r]` (g' = 1 + s'u, 0 at conversion) and the balancing bias `router_bias [N, N'_r]`.

Both levels flatten into one dispatch: a token's k selected experts become
k*(N'_s + N'_k) rows with combine weights w_i (shared) and w_i g'_ij (routed), which run
through `routed_swiglu_experts` like any MoE layer's rows, so every grouped-matmul backend,
LoRA and the expert-parallel path serve it unchanged. The sub-routers run as one grouped
matmul on the tokens sorted by top-level expert: each token pays for k sub-routers only.

ConMoE on a hierarchical layer (`num_prototypes = K`, `cmoe_jax.compress`): the unit is a
top-level expert's family (its N' sub-experts and its sub-router). The layer stores K families
and an int32 `slot_map [N]`; the top-level router still scores all N slots, the selected
slots map to families (gates of slots sharing a family summed, as in
`cmoe_jax.moe.prototypes`), and the sub-routing and dispatch run on the K stored families.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from cmoe_jax.moe.activations import glu_activation
from cmoe_jax.moe.balance import RouterBias, update_router_bias
from cmoe_jax.moe.checks import check_input
from cmoe_jax.moe.dispatch import plan
from cmoe_jax.moe.gmm import get_gmm
from cmoe_jax.moe.mesh_axes import tokens_sharded
from cmoe_jax.moe.modes import PairCall, dispatch_mode
from cmoe_jax.moe.moe_layer import MoELayer, RoutedPairs
from cmoe_jax.moe.params import make_router_params, with_axes
from cmoe_jax.moe.prototypes import SlotMap, to_prototypes
from cmoe_jax.moe.routers import Routing, get_router, router_logits
from cmoe_jax.moe.routers.base import jittered


@dataclasses.dataclass(frozen=True)
class SubRouters:
    """Every top-level expert's sub-router: representative-neuron weights `gate/up
    [N, d, N'_r*r]`, scales `u` and balancing bias `bias [N, N'_r]`; each expert keeps
    `shared` (N'_s) sub-experts always on and picks `top_k` (N'_k) routed ones; `gmm` the
    grouped-matmul backend, `activation` the GLU's."""

    gate: jax.Array
    up: jax.Array
    u: jax.Array
    bias: jax.Array
    shared: int
    top_k: int
    gmm: Callable
    activation: str


def sub_route(x, top_ids, top_w, routers: SubRouters):
    """Flattened (sub-expert ids int32 [T, k*(N'_s+N'_k)], weights float32 [same]).

    `top_ids/top_w [T, k]`: the top-level choice. Sub-router scores s_ij = sum over its r
    neurons of |act(x G) * (x U)|, s' = softmax over j, chosen by top-N'_k of s' + b_i."""
    sub_gate, sub_up, u, bias = routers.gate, routers.up, routers.u, routers.bias
    sub_shared, sub_top_k, gmm = routers.shared, routers.top_k, routers.gmm
    act = glu_activation(routers.activation)
    num_tokens, top_k = top_ids.shape
    n_top, _, cols = sub_gate.shape
    n_routed = u.shape[1]
    n_sub = sub_shared + n_routed
    if dispatch_mode(PairCall(top_ids.size, n_top)) == "gather":  # read only the chosen sub-routers
        rows, flat = jnp.repeat(x.astype(jnp.float32), top_k, axis=0), top_ids.reshape(-1)
        mm = lambda w: jnp.einsum("rd,rdc->rc", rows, jnp.take(w, flat, axis=0).astype(jnp.float32))
        h = act(mm(sub_gate)) * mm(sub_up)
    else:
        d = plan(top_ids, n_top)
        rows = x[d.order // top_k].astype(jnp.float32)
        h = (act(gmm(rows, sub_gate.astype(jnp.float32), d.group_sizes))
             * gmm(rows, sub_up.astype(jnp.float32), d.group_sizes))[d.inverse]
    scores = jnp.abs(h).reshape(num_tokens, top_k, n_routed, cols // n_routed).sum(-1)
    probs = jax.nn.softmax(scores, axis=-1)                          # s' [T, k, N'_r]
    b = jax.lax.stop_gradient(bias.astype(jnp.float32))[top_ids]     # b_i [T, k, N'_r]
    _, picked = jax.lax.top_k(probs + b, sub_top_k)                  # [T, k, N'_k]
    s_sel = jnp.take_along_axis(probs, picked, axis=-1)
    g = 1.0 + s_sel * u.astype(jnp.float32)[top_ids[..., None], picked]
    base = top_ids[..., None].astype(jnp.int32) * n_sub
    w = top_w.astype(jnp.float32)[..., None]
    shared_ids = base + jnp.arange(sub_shared, dtype=jnp.int32)
    ids = jnp.concatenate([shared_ids, base + sub_shared + picked.astype(jnp.int32)], axis=-1)
    weights = jnp.concatenate([jnp.broadcast_to(w, shared_ids.shape), w * g], axis=-1)
    return ids.reshape(num_tokens, -1), weights.reshape(num_tokens, -1)


class HierMoEFFN(MoELayer):
    """Hierarchical CMoE layer (see the module docstring), built like `MoEFFN` (`MoELayer`'s
    arguments) from a spec with `sub_experts` > 0.

    `num_experts` N and `top_k` k of the spec are the top level's (`top_experts`,
    `top_top_k` here); `expert_width` is the sub-expert width m'; `router` (a kind of
    `cmoe_jax.moe.routers`: conversions make "linear" or "cmoe") and `router_neurons`
    describe the top-level router; `sub_experts` N', `sub_shared` N'_s, `sub_top_k` N'_k and
    `sub_router_neurons` r the sub-level. As the experts see it, the layer has
    `num_experts` = N*N' rows and each token uses `top_k` = k*(N'_s + N'_k) of them.

    Parameters: `expert_gate/expert_up [N*N', d, m']`, `expert_down [N*N', m', d]`; the host
    shared MLP as in `MoEFFN`; the top-level router's arrays under their top-level names
    (linear `router_kernel [d, N]`; cmoe `top_gate/top_up [d, N*r0]`, `top_u [N]`,
    `top_bias [N]`); sub-routers `sub_gate/sub_up [N, d, N'_r*r]`, `u [N, N'_r]`,
    `router_bias [N, N'_r]`. `return_load` gives the routed sub-experts' loads `[N, N'_r]`,
    so `update_router_bias` balances each sub-router against its own mean. With
    `num_prototypes` K > 0 the expert tensors, sub-routers, `u` and `router_bias` hold K
    families (`[K*N', d, m']`, `[K, ...]`) behind an int32 `slot_map [N]` (-1: slot pruned)
    and the loads are the stored families' `[K, N'_r]`.
    """

    # what a cross-layer ConMoE scope shares (`tie_prototype_tables`); u and the balancing
    # bias stay per layer, since each layer trains and balances its own
    TABLE_NAMES = ("expert_gate", "expert_up", "expert_down", "sub_gate", "sub_up")

    def build(self, spec, param) -> None:
        n_routed = spec.sub_experts - spec.sub_shared
        if not (spec.sub_experts > 0 and 0 <= spec.sub_shared < spec.sub_experts and 1 <= spec.sub_top_k <= n_routed):
            raise ValueError(f"sub-plan S{spec.sub_shared}A{spec.sub_top_k}E{spec.sub_experts} is invalid")
        self.router_unit.validate(self.router_settings)
        d, m, n = self.d_model, spec.expert_width, spec.num_experts
        if spec.num_prototypes > 0:  # K stored families behind the N top-level slots
            self.slot_map = SlotMap(jnp.arange(n, dtype=jnp.int32) % spec.num_prototypes, **with_axes(("router",)))
        families = spec.num_prototypes or n
        rows = families * spec.sub_experts
        self.expert_gate = param(rows, d, m, axes=("expert", "embed", "mlp"))
        self.expert_up = param(rows, d, m, axes=("expert", "embed", "mlp"))
        self.expert_down = param(rows, m, d, axes=("expert", "mlp", "embed"))
        make_router_params(self, self.router_unit.params(d, self.router_settings), param, self.param_dtype, top_level=True)
        cols = n_routed * spec.sub_router_neurons
        self.sub_gate = param(families, d, cols, axes=("expert", "embed", "router"))
        self.sub_up = param(families, d, cols, axes=("expert", "embed", "router"))
        self.u = nnx.Param(jnp.zeros((families, n_routed), self.param_dtype), **with_axes(("expert", "router")))
        self.router_bias = RouterBias(jnp.zeros((families, n_routed), jnp.float32), **with_axes(("expert", "router")))

    # the two levels, as the spec says them
    top_experts = property(lambda self: self.spec.num_experts, doc="N, the top-level router's slots")
    top_top_k = property(lambda self: self.spec.top_k, doc="k, the top-level experts a token uses")
    sub_experts = property(lambda self: self.spec.sub_experts, doc="N', sub-experts of each expert")
    sub_shared = property(lambda self: self.spec.sub_shared, doc="N'_s, always on with their expert")
    sub_top_k = property(lambda self: self.spec.sub_top_k, doc="N'_k, routed sub-experts chosen")
    num_experts = property(lambda self: self.expert_gate.shape[0], doc="the stored sub-expert rows")
    top_k = property(lambda self: self.spec.top_k * (self.spec.sub_shared + self.spec.sub_top_k),
                     doc="the sub-experts a token runs")

    def top_arrays(self) -> dict:
        """role -> the top-level router's arrays (its unit's `top_name`s)."""
        return {role: getattr(self, p.attr(top_level=True))[...]
                for role, p in self.router_unit.params(self.d_model, self.router_settings).items()}

    def route(self, x: Float[Array, "T d"], key=None) -> tuple[Int[Array, "T r"], Float[Array, "T r"]]:
        """Flattened sub-expert ids and combine weights `[T, k*(N'_s+N'_k)]` (`key`: training,
        the top-level router's jitter if it has one, on the input of both levels)."""
        check_input(x, self.d_model, type(self).__name__)
        x, top = jittered(x, self.router_settings, key), self.top_arrays()
        slots = (self.slot_map[...],) if self.num_prototypes > 0 else ()
        arrays = (top, self.sub_gate[...], self.sub_up[...], self.u[...], self.router_bias[...]) + slots
        return tokens_sharded(self.two_level_route, x, arrays) if self.expert_parallel() else \
            self.two_level_route(x, arrays)

    def two_level_route(self, x, arrays):
        """`route` on arrays (top, sub_gate, sub_up, u, bias[, slot_map]) given whole, so an
        expert-parallel call passes each device its tokens."""
        top, sub_gate, sub_up, u, bias = arrays[:5]
        if self.num_prototypes > 0:  # pruned slots never win; chosen slots -> stored families
            slot_map = arrays[5]
            top_ids, top_w = self.top_route(x, top, keep=slot_map >= 0)
            top_ids, top_w = to_prototypes(top_ids, top_w, slot_map, self.spec.duplicate_gates)
        else:
            top_ids, top_w = self.top_route(x, top)
        return sub_route(x, top_ids, top_w, self.sub_routers((sub_gate, sub_up, u, bias)))

    def sub_routers(self, arrays: tuple | None = None) -> SubRouters:
        """The sub-routers as `sub_route` takes them, from `arrays` (gate, up, u, bias) when
        given (a sharded call's), else from the layer's parameters."""
        if arrays is None:
            arrays = (self.sub_gate[...], self.sub_up[...], self.u[...], self.router_bias[...])
        return SubRouters(*arrays, self.sub_shared, self.sub_top_k, get_gmm(self.backend), self.activation)

    def top_route(self, x, top=None, keep=None):
        """The unchanged top-level choice: expert ids int32 `[T, k]` and weights w `[T, k]`
        (`keep`, bool `[N]`: slots not kept are never chosen)."""
        top = self.top_arrays() if top is None else top
        return self.router_unit.route(x, top, self.router_settings, keep=keep)

    def route_pairs(self, x, key=None) -> RoutedPairs:
        ids, weights = self.route(x, key)
        return RoutedPairs(ids, ids, weights)

    def loads(self, pairs, keep, counts):
        """The routed sub-experts' loads `[N, N'_r]` (each family's own)."""
        return counts.reshape(-1, self.sub_experts)[:, self.sub_shared:]

    def empty_load(self) -> jax.Array:
        return jnp.zeros((self.u.shape[0], self.sub_experts - self.sub_shared), jnp.int32)

    def router_scores(self, x: Float[Array, "T d"]) -> Float[Array, "T N"]:
        """The top-level router's float32 logits `[T, N]` (pruned slots -inf)."""
        keep = self.slot_map[...] >= 0 if self.num_prototypes > 0 else None
        return router_logits(self.router_unit, x, self.top_arrays(), self.router_settings, keep)

    def reported_pairs(self, x, pairs):
        """The top-level choice `[T, k]` (the flattened sub-expert pairs are not what the
        top-level losses describe); no kept pairs."""
        if x.shape[0] == 0:
            return jnp.zeros((0, self.top_top_k), jnp.int32), None
        keep = self.slot_map[...] >= 0 if self.num_prototypes > 0 else None
        return self.top_route(x, keep=keep)[0], None

    def update_bias(self, counts: jax.Array, gamma: float) -> None:
        """Balance every sub-router against its own mean load (`counts [N, N'_r]`)."""
        self.router_bias[...] = update_router_bias(self.router_bias, counts, gamma)


def flops_per_token(d: int, spec) -> dict:
    """Multiply-add FLOPs (2 per MAC) per token of an MoE FFN spec's matmuls: experts, routers,
    host shared MLP. For a hierarchical spec the sub-routers of the k selected experts count."""
    ffn = lambda width: 3 * 2 * d * width
    out = {"shared": ffn(spec.shared_width) if spec.shared_width else 0}
    routing = Routing.of(spec, activation="")  # parameter shapes only: nothing is activated
    out["router"] = sum(2 * p.shape[0] * p.shape[1] for p in get_router(spec.router).params(d, routing).values()
                        if len(p.shape) == 2)
    if getattr(spec, "sub_experts", 0):
        active = spec.top_k * (spec.sub_shared + spec.sub_top_k)
        sub_cols = (spec.sub_experts - spec.sub_shared) * spec.sub_router_neurons
        out["sub_router"] = spec.top_k * 2 * 2 * d * sub_cols
    else:
        active, out["sub_router"] = spec.top_k, 0
    out["experts"] = active * ffn(spec.expert_width)
    out["total"] = sum(out.values())
    return out

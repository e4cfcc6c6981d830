"""`MoEFFN`: a SwiGLU mixture-of-experts FFN with an optional always-on shared MLP.

One module covers the three kinds of MoE FFN the project needs: the layers of sparse
checkpoints (Qwen3-MoE, Mixtral: `router="linear"`), the output of the CMoE converter
(`router="cmoe"`, shared experts fused into one shared MLP) and the dense FFN split into
experts (`router="sum"`, exact). Routed experts are stacked on a leading expert axis and run
with grouped matmuls on tokens sorted by expert (`dispatch`), so the cost follows the
active experts and no token is dropped.

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

import jax
import jax.numpy as jnp
from flax import nnx

from cmoe_jax.lora_variables import factors, grouped_delta, project
from cmoe_jax.moe.activations import glu_activation
from cmoe_jax.moe.balance import update_router_bias
from cmoe_jax.moe.dispatch import GLUExperts, dense_experts, gathered_experts
from cmoe_jax.moe.expert_parallel import DEFAULT_EXPERT_AXIS, routed_swiglu_experts, tokens_sharded
from cmoe_jax.moe.gmm import get_glu, get_gmm
from cmoe_jax.moe.modes import (PairCall, check_input, check_layer, check_mask, dispatch_mode,
                                expert_parallel_active, gather_slabs, pads_every_token, token_devices)
from cmoe_jax.moe.padded import padded_experts
from cmoe_jax.moe.prototypes import TABLE_NAMES, SlotMap, to_prototypes
from cmoe_jax.moe.router_outputs import router_output
from cmoe_jax.moe.params import make_param, make_router_params
from cmoe_jax.moe.routers import Router, Routing, get_router, router_logits
from cmoe_jax.moe.routers.base import jittered, options_of
from cmoe_jax.moe.spec import FFNSpec, spec_with
from cmoe_jax.moe.token_pairs import Pairs, capacity, drop_pairs, kept_pairs, load_of, pad_tokens

# the layer's own settings (not its shape): what a subclass passes on to `MoEFFN.__init__`
LAYER_SETTINGS = ("dtype", "param_dtype", "backend", "expert_axis", "kernel_init", "sow_router", "dispatch")


class MoEFFN(nnx.Module):
    """MoE FFN: `shared(x) + sum_{e in top_k(x)} g_e(x) * expert_e(x)`, x `[..., d_model]`.

    Built from one `FFNSpec` (`spec`, passed whole, as models build their layers) or from its
    fields given as keywords (`MoEFFN(d_model=64, expert_width=32, num_experts=8, top_k=2, activation="silu",
    rngs=...)`); keywords given with a spec replace its fields.

    Args:
      spec: the layer's shape and routing (`cmoe_jax.moe.spec.FFNSpec`, each field documented
        there): `expert_width` m, `num_experts` E, `top_k` k, `shared_width` of the
        always-on shared MLP (0: none), the `router` kind ("linear", the default, trains from
        scratch; "cmoe", "topsum" and "sum" are for carved models: `cmoe_jax.moe.routers`),
        the linear router's options, a capacity factor, ConMoE's prototypes.
    The layer's own settings:
      d_model: model width d.
      activation: the GLU activation of every expert and router neuron ("silu", or the
        source model's, e.g. Gemma's "gelu_pytorch_tanh"); required, so that a layer never
        silently gets another model's activation.
      dtype: compute dtype of the FFN (routing always runs in float32).
      param_dtype: storage dtype of the parameters.
      backend: grouped-matmul backend, "auto" picks per platform (`cmoe_jax.moe.gmm`), or a
        gmm callable.
      expert_axis: mesh axis the routed experts are split over. When the mesh set with
        `jax.set_mesh` has this axis (size > 1) the layer runs expert-parallel
        (`cmoe_jax.moe.expert_parallel`: tokens exchanged by all-to-all); otherwise, or with
        None, every device runs the single-device dispatch (`cmoe_jax.moe.modes`; a mesh
        entered with `with mesh:` warns).
      kernel_init: initializer `init(key, shape, dtype)` of every weight matrix, called with
        the 2-D `[in, out]` shape (stacked experts get one call each); default normal(0.02).
      dispatch: how the routed experts run on one device: "auto" (default) picks at trace time
        from the token count and shapes (`cmoe_jax.moe.modes`); "sort", "gather", "dense" or
        "padded" force one path (same results; for benchmarks and tests).
      sow_router: sow each call's `RouterOutput` as `nnx.Intermediate` "router_outputs" (for
        a layer deep inside a model; `nnx.capture(model, nnx.Intermediate)(x)` returns them).

    Parameters (JAX layout, `[in, out]`): `shared_gate/shared_up [d, S]`,
    `shared_down [S, d]`; `expert_gate/expert_up [E, d, m]`, `expert_down [E, m, d]`;
    linear router `router_kernel [d, E]`; CMoE router `router_gate/router_up [d, E*r]`
    (each expert's r representative neurons, expert-major), `u [E]` (trainable gate scales, init 0) and `router_bias [E]`
    (a `RouterBias`, not a `Param`, init 0).
    """

    LOGICAL_AXES = {
        "shared_gate": ("embed", "mlp"), "shared_up": ("embed", "mlp"), "shared_down": ("mlp", "embed"),
        "expert_gate": ("expert", "embed", "mlp"), "expert_up": ("expert", "embed", "mlp"),
        "expert_down": ("expert", "mlp", "embed"), "slot_map": ("router",),
        "shared_gate_kernel": ("embed", None)}
    TABLE_NAMES = TABLE_NAMES  # what a cross-layer ConMoE scope shares

    def __init__(self, spec: FFNSpec | None = None, *, d_model: int, rngs: nnx.Rngs,
                 activation: str, dtype=jnp.float32, param_dtype=jnp.float32,
                 backend="auto", expert_axis: str | None = DEFAULT_EXPERT_AXIS, kernel_init=None,
                 sow_router: bool = False, dispatch: str = "auto", **fields):
        spec = spec_with(spec, fields, type(self).__name__)
        expert_width, num_experts, top_k = spec.expert_width, spec.num_experts, spec.top_k
        shared_width, router, norm_topk_prob = spec.shared_width, spec.router, spec.norm_topk_prob
        router_neurons, num_prototypes = spec.router_neurons, spec.num_prototypes
        unit = get_router(router)
        unit.validate(Routing.of(spec, activation))
        check_layer(d_model, spec, backend, dispatch)
        self.d_model, self.expert_width = d_model, expert_width
        self.num_experts, self.top_k, self.shared_width = num_experts, top_k, shared_width
        self.router, self.norm_topk_prob = router, norm_topk_prob
        self.router_neurons = router_neurons
        self.dtype, self.param_dtype, self.backend = dtype, param_dtype, backend
        self.expert_axis = expert_axis
        self.activation = activation  # the GLU activation of every expert and router neuron
        # ConMoE (`cmoe_jax.moe.prototypes`): K stored prototypes behind the E router slots
        self.num_prototypes, self.duplicate_gates = num_prototypes, spec.duplicate_gates
        self.sow_router, self.dispatch = sow_router, dispatch
        self.spec = spec  # the layer's shape, as given
        param = make_param(rngs, param_dtype, kernel_init)

        d, m, e, s = d_model, expert_width, num_experts, shared_width
        if s > 0:
            self.shared_gate, self.shared_up, self.shared_down = param(d, s), param(d, s), param(s, d)
        # Qwen2-MoE: the shared MLP's output times sigmoid(x W_sg), `shared_gate_kernel [d, 1]`
        self.shared_gated = spec.shared_gated and s > 0
        if self.shared_gated:
            self.shared_gate_kernel = param(d, 1)
        if num_prototypes > 0:
            self.slot_map = SlotMap(jnp.arange(e, dtype=jnp.int32) % num_prototypes)
            e = num_prototypes
        self.expert_gate, self.expert_up, self.expert_down = param(e, d, m), param(e, d, m), param(e, m, d)
        make_router_params(self, unit.params(d, self.routing), param, param_dtype)

    def route(self, x: jax.Array, key=None) -> tuple[jax.Array, jax.Array]:
        """Expert ids int32 `[T, k]` and float32 gates `[T, k]` for tokens `x [T, d]` (`key`:
        training, the router's jitter if it has one).

        Expert-parallel, each device routes its own tokens (XLA would otherwise gather the
        router scores of all tokens for the top-k)."""
        if getattr(x, "ndim", 0) != 2:
            raise ValueError(f"route expects flattened tokens [T, d_model={self.d_model}], got "
                             f"shape {getattr(x, 'shape', None)}")
        check_input(x, self.d_model, type(self).__name__)
        x, arrays = jittered(x, self.routing, key), self._router_arrays()
        if self.num_prototypes > 0:  # pruned slots (map -1) are never selected
            arrays = dict(arrays, keep=self.slot_map[...] >= 0)
        if self._expert_parallel():
            return tokens_sharded(self._route, x, arrays)
        return self._route(x, arrays)

    @property
    def router_unit(self) -> Router:
        """The router kind's unit (`cmoe_jax.moe.routers`)."""
        return get_router(self.router)

    @property
    def routing(self) -> Routing:
        return Routing(self.num_experts, self.top_k, self.activation, self.norm_topk_prob,
                       self.router_neurons, **options_of(self.spec))

    def variable_axes(self) -> dict:
        """Logical axes of every variable: the class's, and the router unit's."""
        return dict(self.LOGICAL_AXES, **{p.name: p.axes for p in
                                          self.router_unit.params(self.d_model, self.routing).values()})

    def _router_arrays(self) -> dict:
        """role -> the router's arrays (`Router.params`)."""
        return {role: getattr(self, p.name)[...]
                for role, p in self.router_unit.params(self.d_model, self.routing).items()}

    def router_scores(self, x: jax.Array) -> jax.Array:
        """float32 `[T, E]`: what the router ranks for tokens `x [T, d]` (its logits; pruned
        slots -inf)."""
        keep = self.slot_map[...] >= 0 if self.num_prototypes > 0 else None
        return router_logits(self.router_unit, x, self._router_arrays(), self.routing, keep)

    def router_logits(self, x: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """float32 router logits `[T, E]` of tokens `x [T, d]` (`RouterOutput.logits`) and the
        router slots `[T, k]` chosen there (`ids`, what `forward` returned)."""
        return self.router_scores(x), ids

    def _route(self, x, arrays):
        arrays = dict(arrays)
        keep = arrays.pop("keep", None)
        return self.router_unit.route(x, arrays, self.routing, keep=keep)

    def _expert_parallel(self) -> bool:
        return expert_parallel_active(self.expert_axis, self.expert_gate.get_value())

    def shared(self, x: jax.Array, key=None) -> jax.Array:
        """The shared MLP `down(act(x W_gate) * (x W_up))` (zeros when there is none)."""
        if self.shared_width == 0:
            return jnp.zeros_like(x)
        proj = lambda name, inp: project(self, name, inp, getattr(self, name)[...].astype(self.dtype), key)
        act = glu_activation(self.activation)
        out = proj("shared_down", act(proj("shared_gate", x)) * proj("shared_up", x))
        if self.shared_gated:
            out = out * jax.nn.sigmoid(x @ self.shared_gate_kernel[...].astype(self.dtype))
        return out

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None, return_load: bool = False,
                 return_router: bool = False, key=None):
        """`x [..., d_model] -> [..., d_model]` (in `dtype`); with `return_load` also the int32
        `[E]` loads, with `return_router` also a `RouterOutput` (logits, probabilities, load,
        Switch and z losses, dropped share; computed only then), in that order.

        `mask` (bool `[...]`, optional): False for padding, which then runs no routed expert
        and counts in no load or loss (`cmoe_jax.moe.token_pairs`). Adapted weights
        (`cmoe_jax.lora_variables`) add their low-rank updates, the routed experts' through the
        same grouped matmuls; `key` drives the adapters' dropout and the router's jitter."""
        check_input(x, self.d_model, type(self).__name__)
        shape, mask = x.shape, check_mask(mask, x.shape[:-1], type(self).__name__)
        x = x.reshape(-1, self.d_model).astype(self.dtype)
        tokens, keep = x.shape[0], None
        if tokens == 0:
            ids = jnp.zeros((0, self.top_k), jnp.int32)
            y, counts = jnp.zeros(shape, self.dtype), self.empty_load()
        else:  # expert-parallel, padded with masked tokens to split over the devices
            xp, mp = pad_tokens(x, mask, token_devices()) if self._expert_parallel() else (x, mask)
            ids, y, counts, keep = self.forward(xp, key, mp)
            ids, y = ids[:tokens], y[:tokens].reshape(shape)
            keep = None if keep is None else keep[:tokens]
        return self.outputs(x, shape, y, counts, Pairs(ids, mask, keep), return_load, return_router)

    def forward(self, x: jax.Array, key=None, mask=None):
        """Tokens `x [T, d]` (T > 0) and their `mask` -> (router slot ids `[T, k]`, y `[T, d]`,
        loads, the pairs that ran `[T, k]` (None: all))."""
        ids, gates = self.route(x, key)
        slot_ids = ids
        if self.num_prototypes > 0:  # load per router slot; dispatch on the prototypes
            ids, gates = to_prototypes(ids, gates, self.slot_map[...], self.duplicate_gates)
        keep = kept_pairs(ids, self.expert_gate.shape[0], mask, self.spec.capacity_factor,
                          per_device=self._expert_parallel())
        ids, gates = drop_pairs(ids, gates, keep, self.expert_gate.shape[0])
        routed, counts = self.routed(x, ids, gates, key)
        if self.num_prototypes > 0:
            counts = load_of(slot_ids, keep, self.num_experts)
        return slot_ids, (self.shared(x, key).astype(jnp.float32) + routed).astype(self.dtype), counts, keep

    def empty_load(self) -> jax.Array:
        """The loads `return_load` gives for zero tokens."""
        return jnp.zeros((self.num_experts,), jnp.int32)

    def outputs(self, x, shape, y, counts, pairs: Pairs, return_load: bool, return_router: bool):
        """`y`, plus the loads and the router outputs asked for (computed only then)."""
        router = None
        if return_router or self.sow_router:
            router = router_output(*self.router_logits(x, pairs.ids), shape[:-1], mask=pairs.mask,
                                   keep=pairs.keep)
            if self.sow_router:
                self.sow(nnx.Intermediate, "router_outputs", router)
        out = (y,) + ((counts,) if return_load else ()) + ((router,) if return_router else ())
        return out[0] if len(out) == 1 else out

    def routed(self, x: jax.Array, ids: jax.Array, gates: jax.Array, key=None
               ) -> tuple[jax.Array, jax.Array]:
        """float32 `[T, d]` sum of the selected experts' gated outputs and int32 `[E]` loads.

        LoRA factors of the experts (if any) travel with the weights, so expert-parallel each
        device applies the adapters of the experts it holds."""
        c = lambda p: p[...].astype(self.dtype)
        weights = (c(self.expert_gate), c(self.expert_up), c(self.expert_down))
        gmm = get_gmm(self.backend)
        adapters = {n: ab for n in ("gate", "up", "down")
                    if (ab := factors(self, "expert_" + n)) is not None}

        def make_lora(ad):
            return lambda name, rows, sizes: (grouped_delta(self, "expert_" + name, rows, sizes, gmm,
                                                            key, ab=ad[name]) if name in ad else None)

        call = PairCall(ids.size, weights[0].shape[0], ids.shape[1], self.dtype, self.d_model * self.expert_width)
        mode = dispatch_mode(call, self.expert_axis, adapters=bool(adapters),
                             weight=self.expert_gate.get_value(), dispatch=self.dispatch)
        if mode == "gather":
            return gathered_experts(x, ids, gates, *weights, self.activation, slabs=gather_slabs(self.dtype))
        if mode == "dense":
            return dense_experts(x, ids, gates, *weights, activation=self.activation)
        limit = (capacity(x.shape[0] // token_devices(), ids.shape[1], weights[0].shape[0],
                          self.spec.capacity_factor) if self.spec.capacity_factor > 0 else None)
        experts = GLUExperts(*weights, gmm, self.activation, glu=get_glu(self.backend), capacity=limit)
        if mode == "padded":
            return padded_experts(x, ids, gates, experts, cover_tokens=pads_every_token(call))
        return routed_swiglu_experts(x, ids, gates, experts, expert_axis=self.expert_axis,
                                     adapters=adapters or None, make_lora=make_lora,
                                     expert_parallel=mode == "expert_parallel")

    def update_bias(self, counts: jax.Array, gamma: float) -> None:
        """Load balancing step in place: `b += gamma * sign(mean(counts) - counts)` (the cmoe
        router's bias, or the linear router's with `router_balance=True`)."""
        bias = self.router_unit.params(self.d_model, self.routing).get("bias")
        if bias is None:
            raise ValueError(f"router {self.router!r} has no balancing bias (the cmoe router has one; "
                             "the linear router with router_balance=True)")
        var = getattr(self, bias.name)
        var[...] = update_router_bias(var, counts, gamma)


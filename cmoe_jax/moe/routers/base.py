"""What a router kind is: the unit every MoE layer, the calibration passes and the export
read, so a new kind is one module and one registry line (`cmoe_jax.moe.routers`).

A router is stateless: it declares its parameters (`RouterParam`, created and held by the
layer under their own names, so checkpoints name them as before), and turns tokens plus
those arrays into expert ids and gates. All routers work in float32 on flattened tokens
`x [T, d]` and return `(expert_ids int32 [T, k], gates float32 [T, k])`.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RouterParam:
    """One router array: its layer attribute `name` (its name as a hierarchical layer's
    top-level router: `top_name`), `shape`, logical `axes`, and how it starts: "normal"
    (drawn like every weight), "zeros" (a trainable scale that starts off) or "bias" (a
    `RouterBias`: state that balancing moves, never the optimiser)."""

    name: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"
    top_name: str | None = None

    def attr(self, top_level: bool = False) -> str:
        return (self.top_name or self.name) if top_level else self.name


@dataclasses.dataclass(frozen=True)
class Routing:
    """What a router needs besides its arrays: the experts it scores, how many it picks, the
    linear router's renormalisation and the GLU activation of representative-neuron routers."""

    num_experts: int
    top_k: int
    activation: str  # the model's: no default, so a Gemma layer never routes with SiLU
    norm_topk_prob: bool = False
    neurons: int = 1  # representative neurons per expert (cmoe)
    # the optional settings (`OPTIONS`; a kind lists those it implements in `Router.options`)
    balance: bool = False  # a balancing bias steers the choice (linear; cmoe always has one)
    scoring: str = "softmax"  # or "sigmoid"
    scaling: float = 1.0  # the gates' factor
    jitter: float = 0.0  # training: the router's input times U(1 - jitter, 1 + jitter)
    threshold: bool = False  # a chosen expert runs only if its score reaches a fitted threshold (cmoe)

    def __post_init__(self):
        # checked where the routing is used (every trace), so a `top_k` changed after
        # construction fails here in one line rather than deep inside `lax.top_k`
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"router_scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        if not (self.scaling > 0 and 0 <= self.jitter < 1):
            raise ValueError(f"routed_scaling={self.scaling} must be > 0 and router_jitter={self.jitter} in [0, 1)")

    @classmethod
    def of(cls, spec, activation: str) -> "Routing":
        """The routing of an `FFNSpec`'s (top-level) router."""
        return cls(spec.num_experts, spec.top_k, activation, spec.norm_topk_prob, spec.router_neurons,
                   **options_of(spec))


# Routing's optional settings -> the FFNSpec fields that set them
OPTIONS = {"balance": "router_balance", "scoring": "router_scoring", "scaling": "routed_scaling",
           "jitter": "router_jitter", "threshold": "threshold_routing"}


def jittered(x: jax.Array, routing: Routing, key) -> jax.Array:
    """The router's input: `x` times U(1 - jitter, 1 + jitter) per element when the routing
    has jitter and a `key` is given (training), else `x` (Switch Transformer's router noise)."""
    if routing.jitter == 0 or key is None:
        return x
    noise = jax.random.uniform(jax.random.fold_in(key, 0x6A17), x.shape, jnp.float32,
                               1.0 - routing.jitter, 1.0 + routing.jitter)
    return (x.astype(jnp.float32) * noise).astype(x.dtype)


def options_of(spec) -> dict:
    """The optional routing settings an `FFNSpec` asks for."""
    return {name: getattr(spec, field) for name, field in OPTIONS.items()}


class Router(abc.ABC):
    """A router kind. Subclasses set `name` and define `params`, `route` and `logits`;
    `torch_route` is the same routing for the exported transformers model: a module-level
    function `f(torch, act, x, p, r, keep)` (torch passed in, so this package never imports
    it; `r` the routing settings by name: `top_k`, `norm_topk_prob`, `scoring`, `scaling`)
    whose source the export writes into the remote code."""

    name: ClassVar[str]
    # trained beside LoRA adapters: the roles of gate scales `u` and selection bias
    trained: ClassVar[tuple[str, ...]] = ()
    # the gates depend on the router's parameters (a fresh layer learns its routing; a
    # hierarchical layer's top level weighs its experts with them)
    learned_gates: ClassVar[bool] = True
    # the router of transformers' sparse checkpoints (softmax over `x @ kernel`): the only kind
    # the families' own MoE blocks hold, and whose `kernel` a load-balancing loss reads
    checkpoint_router: ClassVar[bool] = False
    torch_route: ClassVar[Callable | None] = None

    # the optional routing settings (`Routing` fields) this kind implements
    options: ClassVar[tuple[str, ...]] = ()

    def validate(self, routing: Routing) -> None:
        """Raise ValueError for a `routing` this kind cannot serve, an optional setting it does
        not implement included (rather than ignoring it)."""
        defaults = {f.name: f.default for f in dataclasses.fields(Routing)}
        for name, field in OPTIONS.items():
            if getattr(routing, name) != defaults[name] and name not in self.options:
                given = [OPTIONS[o] for o in self.options]
                raise ValueError(f"{field} is not an option of the {self.name!r} router (its options: "
                                 f"{', '.join(given) or 'none'})")
        self.check(routing)

    def check(self, routing: Routing) -> None:
        """The kind's own checks of `routing` (`validate` runs them)."""

    @abc.abstractmethod
    def params(self, d_model: int, routing: Routing) -> dict[str, RouterParam]:
        """role -> the array it needs, for `d_model`-wide tokens."""

    @abc.abstractmethod
    def route(self, x: jax.Array, p: dict, routing: Routing, keep=None):
        """(ids int32 `[T, k]`, gates float32 `[T, k]`) of tokens `x [T, d]`; `p` role ->
        array; `keep` (bool `[E]`, optional): experts not kept are never chosen (pruned)."""

    @abc.abstractmethod
    def logits(self, x: jax.Array, p: dict, routing: Routing) -> jax.Array:
        """float32 `[T, E]` scores before the softmax (`RouterOutput.logits`, ConMoE's
        calibration statistics)."""

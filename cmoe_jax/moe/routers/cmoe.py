"""The "cmoe" router (CMoE paper, sec. 3.2-3.3): the representative neurons of the experts.

`s = |act(x W_gate^R) * (x W_up^R)|`, `s' = softmax(s)`; with r router neurons per expert
(columns expert-major, `[d, E*r]`) an expert's score is the sum of its r neurons' `|h|`.
Experts are chosen by `top_k(s' + b)` with the non-trainable balancing bias `b`, and
weighted by `g = 1 + s' * u` with the trainable scales `u` (zero at conversion, so the
experts are then summed unweighted, as in the training-free model).

With threshold routing (`FFNSpec.threshold_routing`) a chosen expert runs only if its score
`s` reaches the layer's `router_threshold`; the others are dropped pairs (id E, gate 0:
`cmoe_jax.moe.token_pairs`). The scores estimate each expert's output norm (their scales are
fitted to it), so one threshold per layer spends a fixed budget of experts where they add
most: a token whose output a few experts carry runs few, an ambiguous one more.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cmoe_jax.moe.activations import glu_activation
from cmoe_jax.moe.routers.base import Router, RouterParam


def _f32_product(x, w):
    """`x @ w` in float32. Operands of one 16-bit dtype stay in it, accumulating in float32:
    their products are exact in float32, so this is the upcast product without the upcast
    copies (XLA:CPU: SmolLM2's bf16 router scores at 4096 tokens 9.0 to 4.7 ms; the same on an
    H200, where XLA fuses the upcast)."""
    if x.dtype == w.dtype and jnp.dtype(x.dtype).itemsize == 2:
        return jnp.dot(x, w, preferred_element_type=jnp.float32)
    return x.astype(jnp.float32) @ w.astype(jnp.float32)


def router_activations(x, router_gate, router_up, *, activation: str):
    """h = act(x W_gate^R) * (x W_up^R) in float32 `[T, E*r]`: the router neurons' activations
    (`router_gate/router_up [d, E*r]`, expert-major); act is the model's GLU activation
    (`cmoe_jax.moe.activations`). The scores and the skipped experts' compensation
    (`cmoe_jax.moe.skip_term`) both read them: one computation under jit."""
    return glu_activation(activation)(_f32_product(x, router_gate)) * _f32_product(x, router_up)


def cmoe_scores(x, router_gate, router_up, num_experts: int | None = None, *, activation: str):
    """s = |h| (`router_activations`) summed over each expert's r router neurons: scores
    `[T, E]`."""
    s = jnp.abs(router_activations(x, router_gate, router_up, activation=activation))
    num_experts = num_experts or s.shape[-1]
    if s.shape[-1] % num_experts:
        raise ValueError(f"{s.shape[-1]} router neurons do not split over {num_experts} experts")
    return s.reshape(*s.shape[:-1], num_experts, -1).sum(-1)


def cmoe_route(x, router_gate, router_up, u, bias, top_k: int, keep=None, *, activation: str):
    """`keep` (bool `[E]`, optional): experts not kept get score -inf (pruned)."""
    scores = cmoe_scores(x, router_gate, router_up, u.shape[0], activation=activation)
    return cmoe_choice(scores, u, bias, top_k, keep)


def cmoe_choice(scores, u, bias, top_k: int, keep=None, threshold=None):
    """(ids int32 `[T, k]`, gates float32 `[T, k]`) from the scores `[T, E]` (`cmoe_scores`):
    top-k of `softmax(s) + b`, gates `1 + s' u`. `keep` (bool `[E]`, optional): experts not
    kept are never chosen (pruned). `threshold` (float32 `[1]`, optional): a chosen expert
    whose score is below it is dropped (id E, gate 0)."""
    num_experts = u.shape[0]
    if keep is not None:
        scores = jnp.where(keep, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # the bias only steers selection and is never trained
    key = probs + jax.lax.stop_gradient(bias.astype(jnp.float32))
    if keep is not None:
        key = jnp.where(keep, key, -jnp.inf)
    _, ids = jax.lax.top_k(key, top_k)
    picked = jnp.take_along_axis(probs, ids, axis=-1)
    gates = 1.0 + picked * u.astype(jnp.float32)[ids]
    if threshold is not None:
        runs = jnp.take_along_axis(scores, ids, axis=-1) >= threshold.astype(jnp.float32)
        ids, gates = jnp.where(runs, ids, num_experts), jnp.where(runs, gates, 0.0)
    return ids.astype(jnp.int32), gates


def torch_cmoe_route(torch, act, x, p, r, keep):
    u = p["u"].float()
    h = torch.abs(act(x @ p["gate"].float()) * (x @ p["up"].float()))
    scores = h.reshape(x.shape[0], u.shape[0], -1).sum(-1)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    key = probs + p["bias"].float()
    ids = torch.topk(key if keep is None else key.masked_fill(~keep, float("-inf")), r["top_k"], dim=-1).indices
    gates = 1.0 + probs.gather(-1, ids) * u[ids]
    if "threshold" in p:  # below it: dropped (id E, which no expert has; gate 0)
        runs = scores.gather(-1, ids) >= p["threshold"].float()
        ids, gates = torch.where(runs, ids, u.shape[0]), torch.where(runs, gates, 0.0)
    return ids, gates


class CmoeRouter(Router):
    name = "cmoe"
    trained = ("u", "bias")
    torch_route = torch_cmoe_route
    options = ("threshold",)

    def check(self, routing):
        if routing.neurons < 1:
            raise ValueError(f"router_neurons={routing.neurons} must be at least 1")

    def params(self, d_model, routing):
        cols, e = routing.num_experts * routing.neurons, routing.num_experts
        return {"gate": RouterParam("router_gate", (d_model, cols), ("embed", "router"), top_name="top_gate"),
                "up": RouterParam("router_up", (d_model, cols), ("embed", "router"), top_name="top_up"),
                "u": RouterParam("u", (e,), ("router",), "zeros", top_name="top_u"),
                "bias": RouterParam("router_bias", (e,), ("router",), "bias", top_name="top_bias"),
                **({"threshold": RouterParam("router_threshold", (1,), (None,), "fixed")} if routing.threshold else {})}

    def route(self, x, p, routing, keep=None):
        scores = cmoe_scores(x, p["gate"], p["up"], routing.num_experts, activation=routing.activation)
        return cmoe_choice(scores, p["u"], p["bias"], routing.top_k, keep, p.get("threshold"))

    def logits(self, x, p, routing):
        return cmoe_scores(x, p["gate"], p["up"], routing.num_experts, activation=routing.activation)

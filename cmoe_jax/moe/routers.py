"""Routers: which `top_k` experts each token uses and with what gate weight.

All routers work in float32 on flattened tokens `x [T, d]` and return
`(expert_ids int32 [T, k], gates float32 [T, k])`.

- "linear" (Qwen3-MoE, Mixtral, ExpertWeaver): softmax over all experts of `x @ W_r`,
  top-k probabilities as gates, optionally renormalised to sum 1 (Mixtral).
- "cmoe" (CMoE paper, sec. 3.2-3.3): the router is the representative neurons of the
  experts, `s = |silu(x W_gate^R) * (x W_up^R)|`, `s' = softmax(s)`; with r router neurons
  per expert (columns expert-major, `[d, E*r]`) an expert's score is the sum of its r
  neurons' `|h|`; experts are chosen by
  `top_k(s' + b)` with the non-trainable balancing bias `b`, and weighted by
  `g = 1 + s' * u` with the trainable scales `u` (zero at conversion, so the experts are
  then summed unweighted, as in the training-free model).
- "topsum" (ExpertWeaver's training-free router): the top-k experts by `x @ W_r`, each of
  weight 1 (the selected experts' outputs are summed unweighted).
- "sum": every expert, weight 1 (the dense FFN split into experts; `top_k == E`).
"""
from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from cmoe_jax.moe.activations import glu_activation

RouterKind = Literal["cmoe", "linear", "sum", "topsum"]
ROUTER_KINDS = ("cmoe", "linear", "sum", "topsum")


def linear_route(x, kernel, top_k: int, norm_topk_prob: bool = False, keep=None):
    """`keep` (bool `[E]`, optional): experts not kept get logit -inf (pruned)."""
    logits = jnp.dot(x.astype(jnp.float32), kernel.astype(jnp.float32))
    if keep is not None:
        logits = jnp.where(keep, logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    gates, ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), gates


def cmoe_scores(x, router_gate, router_up, num_experts: int | None = None, activation: str = "silu"):
    """s = |act(x W_gate^R) * (x W_up^R)| in float32, summed over each expert's r router
    neurons (`router_gate/router_up [d, E*r]`, expert-major): scores `[T, E]`; act is the
    model's GLU activation (`cmoe_jax.moe.activations`)."""
    x = x.astype(jnp.float32)
    s = jnp.abs(glu_activation(activation)(x @ router_gate.astype(jnp.float32))
                * (x @ router_up.astype(jnp.float32)))
    num_experts = num_experts or s.shape[-1]
    if s.shape[-1] % num_experts:
        raise ValueError(f"{s.shape[-1]} router neurons do not split over {num_experts} experts")
    return s.reshape(*s.shape[:-1], num_experts, -1).sum(-1)


def cmoe_route(x, router_gate, router_up, u, bias, top_k: int, keep=None, activation: str = "silu"):
    """`keep` (bool `[E]`, optional): experts not kept get score -inf (pruned)."""
    scores = cmoe_scores(x, router_gate, router_up, u.shape[0], activation)
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
    return ids.astype(jnp.int32), gates


def sum_route(num_tokens: int, num_experts: int):
    ids = jnp.broadcast_to(jnp.arange(num_experts, dtype=jnp.int32), (num_tokens, num_experts))
    return ids, jnp.ones((num_tokens, num_experts), jnp.float32)


def topsum_route(x, kernel, top_k: int, keep=None):
    """The top-k experts by the logits `x @ W_r`, gates 1 (ExpertWeaver, training-free);
    `keep` as in `linear_route`."""
    logits = jnp.dot(x.astype(jnp.float32), kernel.astype(jnp.float32))
    if keep is not None:
        logits = jnp.where(keep, logits, -jnp.inf)
    _, ids = jax.lax.top_k(logits, top_k)
    return ids.astype(jnp.int32), jnp.ones(ids.shape, jnp.float32)

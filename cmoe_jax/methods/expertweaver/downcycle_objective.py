"""Downcycling (ExpertWeaver mode 6): full-parameter training of a woven MoE with softmax routers.

Loss = mean next-token NLL + lambda * sum over MoE layers of N_e sum_i f_i P_i, where per
layer f_i is the share of the step's (token, slot) routing choices that picked expert i
(no gradient: a count) and P_i the token mean of expert i's router probability. The router
probabilities are recomputed from each layer's captured FFN input, so `MoEFFN` is untouched.

Every parameter (embeddings, attention, norms, experts, routers) is trained with AdamW
(warm-up then cosine to 10%, as the paper's CPT): `downcycle_optimizer`. The job that runs it
is `cmoe_jax.downcycle` (on the training package's train state, checkpoints and step loop).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from cmoe_jax.models.decoder import chunked_nll


def load_balance_loss(x, kernel, top_k: int):
    """N_e sum_i f_i P_i for tokens x [T, d] and a softmax router `kernel [d, N_e]`."""
    probs = jax.nn.softmax(x.astype(jnp.float32) @ kernel.astype(jnp.float32), axis=-1)
    _, ids = jax.lax.top_k(probs, top_k)
    e = kernel.shape[-1]
    f = jax.nn.one_hot(ids, e, dtype=jnp.float32).sum(axis=(0, 1)) / ids.size
    return e * jnp.sum(jax.lax.stop_gradient(f) * probs.mean(axis=0))


def downcycle_loss(model, tokens, aux_coef: float, remat: bool = False):
    """(total loss, (nll, aux)) of a batch [B, T] for a model whose MoE layers use "linear"."""
    h, inputs, _ = model.run_layers(tokens, capture=True, remat=remat)
    nll = chunked_nll(model.norm(h)[:, :-1], tokens[:, 1:], model.lm_head_matrix(), remat=remat).mean()
    aux = jnp.zeros((), jnp.float32)
    for layer, x in zip(model.layers, inputs):
        mlp = layer.mlp
        unit = getattr(mlp, "router_unit", None)
        if unit is not None and unit.checkpoint_router:
            aux = aux + load_balance_loss(x.reshape(-1, x.shape[-1]), mlp.router_kernel[...], mlp.top_k)
    return nll + aux_coef * aux, (nll, aux)


def lr_schedule(lr: float, steps: int, warmup: int):
    return optax.warmup_cosine_decay_schedule(0.0, lr, max(1, min(warmup, steps - 1)), max(steps, 2),
                                              end_value=lr * 0.1)


def downcycle_optimizer(lr: float, steps: int, warmup: int, weight_decay: float = 0.0):
    """AdamW (0.9 / 0.95) on `lr_schedule`."""
    return optax.adamw(lr_schedule(lr, steps, warmup), b1=0.9, b2=0.95, weight_decay=weight_decay)


def randomize_experts(model, seed: int):
    """`model` with every FFN weight (experts, shared experts, routers) drawn afresh, N(0, 0.02),
    shapes kept: the "random" initialisation downcycling is compared against."""
    key = jax.random.key(seed)
    for i, layer in enumerate(model.unstacked().layers):  # editable copies, written back
        for j, (_, var) in enumerate(nnx.to_flat_state(nnx.state(layer.mlp, nnx.Param))):
            value = var.get_value()
            var.set_value(0.02 * jax.random.normal(jax.random.fold_in(key, 1000 * i + j), value.shape,
                                                   value.dtype))
        model.set_layer(i, layer)
    return model

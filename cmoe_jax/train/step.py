"""Optimizer, train state, shardings and the jitted train step.

The train state is a plain pytree::

    {"trainable": {"lora": adapters, "u": {layer: u}},   # what Adam updates
     "opt": optax state, "bias": {layer: b}, "step": int32}

LoRA A/B and the router scales u get separate Adam instances (betas 0.9 / 0.95) with their
own constant learning rates through `optax.multi_transform`. The selection biases b are
moved by `+-bias_speed` from the step's expert loads after the update, outside the gradient.
The frozen model weights are a separate, non-donated argument.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cmoe_jax.moe.balance import update_router_bias
from cmoe_jax.sharding import batch_axes, placed_split
from cmoe_jax.models.adapters import router_params
from cmoe_jax.train.lora_targets import LoRAConfig, adapter_specs, init_adapters, lora_loss, named


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 5.95e-5
    router_lr: float = 1e-3
    bias_speed: float = 1e-3
    b1: float = 0.9
    b2: float = 0.95


def make_optimizer(trainable: dict, oc: OptimConfig) -> optax.GradientTransformation:
    labels = {"lora": jax.tree.map(lambda _: "lora", trainable["lora"]),
              "u": jax.tree.map(lambda _: "router", trainable["u"])}
    return optax.multi_transform({"lora": optax.adam(oc.lr, b1=oc.b1, b2=oc.b2),
                                  "router": optax.adam(oc.router_lr, b1=oc.b1, b2=oc.b2)}, labels)


def init_state(model, lora: LoRAConfig, oc: OptimConfig, key: jax.Array, mesh: Mesh):
    """(train state, its NamedShardings, optimizer) placed on `mesh`."""
    us, bs = router_params(model)
    replicated = NamedSharding(mesh, P())
    trainable = {"lora": init_adapters(model, lora, key), "u": us}
    tx = make_optimizer(trainable, oc)
    train_sh = {"lora": named(adapter_specs(model, lora, mesh), mesh),
                "u": jax.tree.map(lambda _: replicated, us)}
    opt_abstract = jax.eval_shape(tx.init, trainable)
    opt_sh = jax.tree_util.tree_map_with_path(
        lambda path, leaf: _param_sharding_of(path, leaf, train_sh, replicated), opt_abstract)
    shardings = {"trainable": train_sh, "opt": opt_sh,
                 "bias": jax.tree.map(lambda _: replicated, bs), "step": replicated}
    trainable = jax.device_put(trainable, train_sh)
    opt = jax.jit(tx.init, out_shardings=opt_sh)(trainable)
    state = {"trainable": trainable, "opt": opt, "bias": jax.device_put(bs, shardings["bias"]),
             "step": jax.device_put(jnp.zeros((), jnp.int32), replicated)}
    return state, shardings, tx


def _param_sharding_of(path, leaf, train_sh, default):
    """An optimizer-state leaf (Adam's mu / nu of a parameter) gets its parameter's sharding:
    the trailing dict keys of its path are the parameter's path in the trainable tree."""
    keys = []
    for k in reversed(path):
        if not isinstance(k, jax.tree_util.DictKey):
            break
        keys.append(k.key)
    node = train_sh
    for k in reversed(keys):
        node = node.get(k) if isinstance(node, dict) else None
    if isinstance(node, NamedSharding) and keys:
        return node
    return default


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(batch_axes(mesh), None))


def lm_loss(graphdef, lora: LoRAConfig, remat: bool = False) -> Callable:
    """The step's default objective: the next-token NLL of `lora_loss` on the model
    `graphdef` + `frozen` with the trainable adapters."""

    def loss(trainable, frozen, bias, tokens, key):
        model = nnx.merge(graphdef, frozen)
        return lora_loss(model, lora.applied(trainable["lora"], trainable["u"], bias), tokens,
                         key=key, remat=remat)

    return loss


def make_train_step(loss: Callable, tx, shardings, frozen_sh, mesh: Mesh, *, seed: int = 0,
                    bias_speed: float = 1e-3) -> Callable:
    """`step(state, frozen, tokens) -> (state, loss, loads)`, jitted, state donated.

    `loss(trainable, frozen, bias, tokens, key) -> (loss, loads)`: the objective (`lm_loss`,
    or distillation's `cmoe_jax.train.distill.distill_loss`); the dropout key of a step is
    `fold_in(key(seed), step)`; the selection biases move by `bias_speed` (`OptimConfig`)."""
    replicated = NamedSharding(mesh, P())

    def step(state, frozen, tokens):
        key = jax.random.fold_in(jax.random.key(seed), state["step"])
        (value, loads), grads = jax.value_and_grad(loss, has_aux=True)(
            state["trainable"], frozen, state["bias"], tokens, key)
        updates, opt = tx.update(grads, state["opt"], state["trainable"])
        trainable = optax.apply_updates(state["trainable"], updates)
        bias = {k: update_router_bias(b, loads[k], bias_speed) for k, b in state["bias"].items()}
        new = {"trainable": trainable, "opt": opt, "bias": bias, "step": state["step"] + 1}
        return new, value, loads

    loads_sh = jax.tree.map(lambda _: replicated, shardings["bias"])
    return jax.jit(step, donate_argnums=(0,),
                   in_shardings=(shardings, frozen_sh, batch_sharding(mesh)),
                   out_shardings=(shardings, replicated, loads_sh))


def split_frozen(model, mesh: Mesh):
    """(graphdef, model state placed on `mesh`, its shardings): the frozen weights the step reads.

    Every variable follows its logical axes and `cmoe_jax.sharding.RULES`.
    """
    graphdef, state = placed_split(model, mesh)
    return graphdef, state, jax.tree.map(lambda a: a.sharding, state)

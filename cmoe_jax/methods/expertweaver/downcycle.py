"""Downcycling (ExpertWeaver mode 6): full-parameter training of a woven MoE with softmax routers.

Loss = mean next-token NLL + lambda * sum over MoE layers of N_e sum_i f_i P_i, where per
layer f_i is the share of the step's (token, slot) routing choices that picked expert i
(no gradient: a count) and P_i the token mean of expert i's router probability. The router
probabilities are recomputed from each layer's captured FFN input, so `MoEFFN` is untouched.

Every parameter (embeddings, attention, norms, experts, routers) is trained with AdamW
(warm-up then cosine to 10%, as the paper's CPT). Parameters are placed by their logical axes
over the mesh (`cmoe_jax.sharding`), as in LoRA training; the run checkpoints its parameters,
optimizer state and log with Orbax every `save_every` steps and resumes from the latest.
"""
from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from cmoe_jax.models.decoder import chunked_nll
from cmoe_jax.sharding import make_mesh, placed_split


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
        if getattr(mlp, "router", None) == "linear":
            aux = aux + load_balance_loss(x.reshape(-1, x.shape[-1]), mlp.router_kernel[...], mlp.top_k)
    return nll + aux_coef * aux, (nll, aux)


def lr_schedule(lr: float, steps: int, warmup: int):
    return optax.warmup_cosine_decay_schedule(0.0, lr, max(1, min(warmup, steps - 1)), max(steps, 2),
                                              end_value=lr * 0.1)


class Downcycler:
    """Train state, jitted step and Orbax checkpoints of one downcycling run."""

    def __init__(self, model, *, steps: int, lr: float = 4e-4, warmup: int = 20,
                 aux_coef: float = 0.01, weight_decay: float = 0.0, remat: bool = False,
                 mesh=None):
        self.mesh = make_mesh() if mesh is None else mesh
        self.graphdef, params = placed_split(model, self.mesh)
        self.tx = optax.adamw(lr_schedule(lr, steps, warmup), b1=0.9, b2=0.95, weight_decay=weight_decay)
        p_sh = jax.tree.map(lambda a: a.sharding, params)
        replicated = NamedSharding(self.mesh, P())
        opt = jax.jit(self.tx.init)(params)
        self.state = {"params": params, "opt": opt,
                      "step": jax.device_put(jnp.zeros((), jnp.int32), replicated)}
        state_sh = jax.tree.map(lambda a: a.sharding, self.state)
        self.batch_sharding = NamedSharding(self.mesh, P("data", None))
        graphdef, tx = self.graphdef, self.tx

        def step(state, tokens):
            def loss_fn(p):
                return downcycle_loss(nnx.merge(graphdef, p), tokens, aux_coef, remat)

            (loss, (nll, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
            updates, opt = tx.update(grads, state["opt"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            params = jax.tree.map(lambda a, s: jax.lax.with_sharding_constraint(a, s), params, p_sh)
            return {"params": params, "opt": opt, "step": state["step"] + 1}, loss, nll, aux

        # fixed in/out shardings: the donated state keeps its placement, one compilation
        self.step_fn = jax.jit(step, donate_argnums=(0,), in_shardings=(state_sh, self.batch_sharding),
                               out_shardings=(state_sh, replicated, replicated, replicated))

    def model(self):
        return nnx.merge(self.graphdef, self.state["params"])

    def train_step(self, tokens: np.ndarray) -> dict:
        t0 = time.perf_counter()
        self.state, loss, nll, aux = self.step_fn(self.state, jax.device_put(tokens, self.batch_sharding))
        loss = float(loss)
        return {"step": int(self.state["step"]), "loss": loss, "nll": float(nll), "aux": float(aux),
                "seconds": time.perf_counter() - t0}

    # ---- checkpoints -------------------------------------------------------------------
    def _saveable(self, state) -> dict:
        leaves = jax.tree.leaves(state["opt"])
        return {"params": nnx.to_pure_dict(state["params"]), "step": state["step"],
                "opt": {f"{i:05d}": leaf for i, leaf in enumerate(leaves)}}

    def save(self, manager: ocp.CheckpointManager, log: list) -> None:
        step = int(self.state["step"])
        manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(self._saveable(self.state)),
                                                   meta=ocp.args.JsonSave({"log": log})), force=True)
        manager.wait_until_finished()

    def restore(self, manager: ocp.CheckpointManager) -> list:
        """Load the latest checkpoint into the state (placed as now); returns its log."""
        step = manager.latest_step()
        if step is None:
            return []
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                              self._saveable(self.state))
        got = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                            meta=ocp.args.JsonRestore()))
        saved = got["state"]
        params = self.state["params"]
        nnx.replace_by_pure_dict(params, saved["params"])
        opt = jax.tree.unflatten(jax.tree.structure(self.state["opt"]),
                                 [saved["opt"][k] for k in sorted(saved["opt"])])
        self.state = {"params": params, "opt": opt, "step": saved["step"]}
        return got["meta"]["log"]


def checkpoint_manager(directory: Path, keep: int = 2) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(Path(directory).absolute(), options=ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=False, create=True))

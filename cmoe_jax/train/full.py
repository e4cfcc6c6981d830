"""Full-parameter training (downcycling): every parameter of the model trained by one optimizer.

Parameters are placed by their logical axes over the mesh (`cmoe_jax.sharding`), as in LoRA
training; the train state `{"params", "opt", "step"}` is checkpointed through the run's
`RunCheckpoints` (parameters as nested dicts, the optimizer state as its leaves).
"""
from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from cmoe_jax.sharding import make_mesh, placed_split
from cmoe_jax.train.run_checkpoints import RunCheckpoints


class FullTrainer:
    """Train state and jitted step of `model` under optimizer `tx` and objective
    `loss(model, tokens [B, T]) -> (loss, (scalar, ...))`; `metrics` names those scalars in
    each step's record."""

    def __init__(self, model, tx: optax.GradientTransformation, loss: Callable,
                 metrics: tuple[str, ...] = (), mesh=None):
        self.metrics = metrics
        self.mesh = make_mesh() if mesh is None else mesh
        self.graphdef, params = placed_split(model, self.mesh)
        p_sh = jax.tree.map(lambda a: a.sharding, params)
        replicated = NamedSharding(self.mesh, P())
        self.state = {"params": params, "opt": jax.jit(tx.init)(params),
                      "step": jax.device_put(jnp.zeros((), jnp.int32), replicated)}
        state_sh = jax.tree.map(lambda a: a.sharding, self.state)
        self.batch_sharding = NamedSharding(self.mesh, P("data", None))
        graphdef = self.graphdef

        def step(state, tokens):
            def loss_fn(p):
                return loss(nnx.merge(graphdef, p), tokens)

            (value, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
            updates, opt = tx.update(grads, state["opt"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            params = jax.tree.map(lambda a, s: jax.lax.with_sharding_constraint(a, s), params, p_sh)
            return {"params": params, "opt": opt, "step": state["step"] + 1}, value, metrics

        # fixed in/out shardings: the donated state keeps its placement, one compilation
        self.step_fn = jax.jit(step, donate_argnums=(0,), in_shardings=(state_sh, self.batch_sharding),
                               out_shardings=(state_sh, replicated, replicated))

    def model(self):
        return nnx.merge(self.graphdef, self.state["params"])

    def train_step(self, tokens: np.ndarray) -> dict:
        """One step on `tokens`; its record {"step", "loss", the objective's metrics, "seconds"}."""
        t0 = time.perf_counter()
        self.state, loss, metrics = self.step_fn(self.state, jax.device_put(tokens, self.batch_sharding))
        loss = float(loss)
        return {"step": int(self.state["step"]), "loss": loss,
                **{k: float(v) for k, v in zip(self.metrics, metrics)}, "seconds": time.perf_counter() - t0}

    def _saved(self) -> dict:
        return {"params": nnx.to_pure_dict(self.state["params"]), "step": self.state["step"],
                "opt": self.state["opt"]}

    def save(self, checkpoints: RunCheckpoints, log: list) -> None:
        checkpoints.save(int(self.state["step"]), self._saved(), {"log": log})

    def restore(self, checkpoints: RunCheckpoints) -> list:
        """Load the latest checkpoint into the state (placed as now); returns its log."""
        step = checkpoints.latest_step()
        if step is None:
            return []
        saved, meta = checkpoints.restore(step, self._saved())
        params = self.state["params"]
        nnx.replace_by_pure_dict(params, saved["params"])
        self.state = {"params": params, "opt": saved["opt"], "step": saved["step"]}
        return meta["log"]

"""Knowledge distillation from the dense source into the converted model (`train --distill`).

A converted model has its teacher at hand: the dense model it was carved from. The student
(the converted model with its LoRA adapters, router scales u and biases b, trained as in
plain LoRA) learns the teacher's next-token distribution instead of, or besides, the one
observed token:

    loss = kd_weight * T^2 * KL(p_teacher^T || p_student^T) + (1 - kd_weight) * NLL
           + hidden_weight * mean over layers of ||x_s - x_t||^2 / ||x_t||^2

`p^T` is the softmax of logits / T; with `top_k` both distributions are restricted to (and
renormalised over) the teacher's k most likely tokens, so a student equal to its teacher
has loss 0 either way. `x` is each layer's FFN input (the normalised residual stream):
matching it keeps every layer's stream near the dense one. The teacher runs in the same jit
as the student, frozen, outside the gradient; the LM head runs over chunks of positions,
so `[B, T, vocab]` logits are never stored (as `chunked_nll`), and one head product per
tile serves both the KL and the NLL.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from cmoe_jax.errors import TrainError
from cmoe_jax.models.adapters import AdapterSet, adapted_run
from cmoe_jax.train.lora_targets import LoRAConfig


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    temperature: float = 1.0
    kd_weight: float = 1.0  # the KL's share; the LM loss gets 1 - kd_weight
    top_k: int | None = None  # None: the whole vocabulary
    hidden_weight: float = 0.0  # per-layer FFN-input matching (0: off)

    def validate(self) -> None:
        if not self.temperature > 0:
            raise TrainError(f"--kd-temperature must be positive, got {self.temperature}")
        if not 0.0 <= self.kd_weight <= 1.0:
            raise TrainError(f"--kd-weight must be in [0, 1], got {self.kd_weight}")
        if self.top_k is not None and self.top_k < 1:
            raise TrainError(f"--kd-top-k must be at least 1, got {self.top_k}")
        if not self.hidden_weight >= 0:
            raise TrainError(f"--hidden-weight must be non-negative, got {self.hidden_weight}")

    def settings(self) -> dict:
        return dataclasses.asdict(self)


def kd_tile(zs: jax.Array, zt: jax.Array, labels: jax.Array, cfg: DistillConfig):
    """(T^2-scaled KL of the teacher's to the student's distribution, student NLL of `labels`)
    per position, from logits `zs`, `zt [..., vocab]` (float32)."""
    nll = jax.nn.logsumexp(zs, axis=-1) - jnp.take_along_axis(zs, labels[..., None], axis=-1)[..., 0]
    if cfg.top_k is not None and cfg.top_k < zt.shape[-1]:
        zt, idx = jax.lax.top_k(zt, cfg.top_k)
        zs = jnp.take_along_axis(zs, idx, axis=-1)
    log_t = jax.nn.log_softmax(zt / cfg.temperature, axis=-1)
    log_s = jax.nn.log_softmax(zs / cfg.temperature, axis=-1)
    kl = jnp.sum(jnp.exp(log_t) * (log_t - log_s), axis=-1)
    return cfg.temperature ** 2 * kl, nll


def chunked_kd(hs, ht, labels, head_s, head_t, cfg: DistillConfig, chunk: int = 128):
    """(KL [B, T], NLL [B, T]) of `kd_tile` on logits `hs @ head_s` and `ht @ head_t`, one
    `[B, chunk, vocab]` tile of each at a time, recomputed in the backward pass."""
    b, t, _ = hs.shape
    chunk = min(chunk, t)
    n = -(-t // chunk)

    def tiles(x):  # [B, T, ...] -> [n, B, chunk, ...], zero-padded
        x = jnp.pad(x, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (x.ndim - 2))
        return jnp.swapaxes(x.reshape(b, n, chunk, *x.shape[2:]), 0, 1)

    def one(args):
        xs, xt, lx = args
        zt = jax.lax.stop_gradient((xt @ head_t).astype(jnp.float32))
        return kd_tile((xs @ head_s).astype(jnp.float32), zt, lx, cfg)

    kl, nll = jax.lax.map(jax.checkpoint(one), (tiles(hs), tiles(ht), tiles(labels)))
    untile = lambda v: jnp.swapaxes(v, 0, 1).reshape(b, n * chunk)[:, :t]  # noqa: E731
    return untile(kl), untile(nll)


def hidden_match(student_inputs: list, teacher_inputs: list) -> jax.Array:
    """Mean over layers of the relative squared error of the student's FFN inputs."""
    errs = [jnp.sum(jnp.square(s.astype(jnp.float32) - t.astype(jnp.float32)))
            / jnp.maximum(jnp.sum(jnp.square(t.astype(jnp.float32))), 1e-30)
            for s, t in zip(student_inputs, teacher_inputs)]
    return jnp.mean(jnp.stack(errs))


def distill_objective(model, teacher, adapters: AdapterSet, tokens, cfg: DistillConfig, *,
                      key=None, remat: bool = False):
    """(distillation loss, expert loads) of `model` adapted by `adapters` against the frozen
    `teacher` (both `Decoder`s) on `tokens [B, T]`."""
    capture = cfg.hidden_weight > 0
    hs, xs, loads = adapted_run(model, adapters, tokens, key=key, remat=remat, capture=capture)
    ht, xt, _ = jax.lax.stop_gradient(teacher.run_layers(tokens, capture=capture))
    kl, nll = chunked_kd(model.norm(hs)[:, :-1], teacher.norm(ht)[:, :-1], tokens[:, 1:],
                         model.lm_head_matrix(), teacher.lm_head_matrix(), cfg)
    loss = cfg.kd_weight * jnp.mean(kl) + (1.0 - cfg.kd_weight) * jnp.mean(nll)
    if capture:
        loss = loss + cfg.hidden_weight * hidden_match(xs, xt)
    return loss, loads


def distill_loss(graphdef, teacher, lora: LoRAConfig, cfg: DistillConfig, remat: bool = False):
    """The train step's `loss(trainable, frozen, bias, tokens, key)`: `frozen` is
    `{"model": the student's weights, "teacher": the teacher's own weights}`, the teacher
    rebuilt from both (`SharedTeacher.model`)."""

    def loss(trainable, frozen, bias, tokens, key):
        model = nnx.merge(graphdef, frozen["model"])
        return distill_objective(model, teacher.model(frozen["model"], frozen["teacher"]),
                                 lora.applied(trainable["lora"], trainable["u"], bias), tokens, cfg,
                                 key=key, remat=remat)

    return loss

"""What a fine-tuning run refuses before it reads a weight: its settings, the model it is
given (context, adapter targets and rank, shared prototype tables), and a mesh that cannot
split its batch or experts."""
from __future__ import annotations

import math

from cmoe_jax.errors import TrainError
from cmoe_jax.train.lora_targets import adapted_weights
from cmoe_jax.train.settings import TrainSettings


def check_settings(s: TrainSettings) -> None:
    """The settings' own checks (before the model is opened)."""
    if s.samples < 1:
        raise TrainError(f"--samples must be at least 1, got {s.samples}")
    if s.seqlen < 2:
        raise TrainError(f"--seqlen must be at least 2, got {s.seqlen}")
    if s.save_every is not None and s.save_every < 1:
        raise TrainError(f"--save-every must be at least 1, got {s.save_every}")
    if s.max_steps is not None and s.max_steps < 0:
        raise TrainError(f"--max-steps must be non-negative, got {s.max_steps}")
    if s.dtype not in ("float32", "bfloat16"):
        raise TrainError(f"--dtype must be float32 or bfloat16, got {s.dtype!r}")
    for name, value in (("--lr", s.optim.lr), ("--router-lr", s.optim.router_lr),
                        ("--bias-speed", s.optim.bias_speed)):
        if not value >= 0:
            raise TrainError(f"{name} must be non-negative, got {value}")


def check_finite(model) -> None:
    """One line, before anything is written, when training left a weight NaN or infinite."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from cmoe_jax.state_digests import path_name

    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model)):
        if jnp.issubdtype(leaf.dtype, jnp.floating) and not bool(jnp.isfinite(leaf).all()):
            raise TrainError(f"training made {path_name(path)} of the model NaN or infinite: nothing was "
                             "written; lower --lr or --lora-alpha")


def check_model(cfg, s: TrainSettings, lora) -> list:
    """Everything about the model that can be wrong, before any weight is loaded."""
    from flax import nnx

    from cmoe_jax.models import Decoder

    if s.seqlen > cfg.max_position_embeddings:
        raise TrainError(f"--seqlen {s.seqlen} exceeds the model's context "
                         f"({cfg.max_position_embeddings} positions)")
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    adapted = adapted_weights(abstract, lora.targets)  # targets that match nothing fail here
    full_rank = max(min(shape[-2:]) for _, shape in adapted)
    if lora.rank > full_rank:
        raise TrainError(f"--lora-rank {lora.rank} exceeds the rank of every adapted weight "
                         f"(at most {full_rank}): give at most {full_rank}")
    tied = [i for i, spec in enumerate(cfg.moe_layers) if spec is not None and spec.prototype_owner >= 0]
    if tied and any(p[1] in tied and p[3].startswith("expert_") for p, _ in adapted):
        raise TrainError("the model shares prototype tables across layers (compressed with "
                         "--scope > 1): per-layer adapters cannot be merged into a shared table; "
                         "compress with --scope 1, or leave the routed experts out of --targets")
    return adapted


def training_mesh(s: TrainSettings, cfg, devices):
    """The mesh over all processes' devices, checked against the batch and the experts."""
    import jax

    from cmoe_jax.sharding import batch_axes, make_mesh

    routed = {spec.num_experts for spec in cfg.moe_layers if spec is not None}
    if s.expert_parallel > 1 and (not routed or any(n % s.expert_parallel for n in routed)):
        raise TrainError(f"--expert-parallel {s.expert_parallel} must divide the number of routed "
                         f"experts of every MoE layer ({sorted(routed) or 'the model has none'})")
    model_par = 1 if s.mesh_shape is None else s.mesh_shape[1]
    mesh = make_mesh(None if s.mesh_shape is None else s.mesh_shape[0], model_par,
                     expert=s.expert_parallel,
                     devices=jax.devices() if devices is None else devices)  # all processes
    data_par = math.prod(dict(mesh.shape)[a] for a in batch_axes(mesh))
    if s.batch_size % data_par:
        raise TrainError(f"--batch-size {s.batch_size} is not a multiple of the {data_par} devices "
                         "the batch is split over (data x expert axes of the mesh)")
    if s.expert_parallel > 1 and (s.batch_size * s.seqlen) % mesh.size:
        raise TrainError(f"--batch-size x --seqlen = {s.batch_size * s.seqlen} tokens must split over "
                         f"all {mesh.size} devices for the expert all-to-all")
    return mesh

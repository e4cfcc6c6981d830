"""Mixture-of-experts FFN layer: routers, token dispatch, grouped matmuls, load balancing.

`MoEFFN` is the public layer (`HierMoEFFN` its hierarchical form, `MoELayer` what both do
with a call's tokens); `grouped_matmul` the
grouped matmul with per-platform backends (subpackage `cmoe_jax.moe.gmm`: CPU expert loop,
Pallas GPU kernel, megablox on TPU, `ragged_dot`, dense reference); `RouterOutput` the
opt-in router logits, probabilities, load and losses; `update_router_bias` the CMoE /
DeepSeek-V3 balancing step; `routed_swiglu_experts` the routed experts on one device or
expert-parallel (all-to-all over a mesh's "expert" axis). Guide: docs/guides/moe-layer.md.

Importing this package loads JAX and Flax only (no checkpoint, tokenizer or dataset library).

Example::

    from flax import nnx
    from cmoe_jax.moe import MoEFFN
    layer = MoEFFN(d_model=576, expert_width=192, num_experts=8, top_k=2, shared_width=192, activation="silu",
                   rngs=nnx.Rngs(0))
"""
from cmoe_jax.moe.balance import RouterBias, RouterThreshold, update_router_bias
from cmoe_jax.moe.dispatch import GLUExperts, routed_experts
from cmoe_jax.moe.expert_parallel import routed_experts_sharded, routed_swiglu_experts
from cmoe_jax.moe.gmm import BACKENDS, get_gmm, resolve_backend
from cmoe_jax.moe.gmm import gmm as grouped_matmul
from cmoe_jax.moe.hierarchical import HierMoEFFN
from cmoe_jax.moe.layer import MoEFFN
from cmoe_jax.moe.mesh_axes import ExpertParallelWarning
from cmoe_jax.moe.moe_layer import MoELayer
from cmoe_jax.moe.router_outputs import RouterOutput
from cmoe_jax.moe.routers import ROUTER_KINDS, RouterKind

# `cmoe_jax.moe.gmm` stays the subpackage (`import cmoe_jax.moe.gmm.pallas_gpu` works): the
# function is exported as `grouped_matmul`, never bound to the subpackage's name here.
__all__ = ["MoELayer", "MoEFFN", "HierMoEFFN", "RouterOutput", "RouterKind", "ROUTER_KINDS", "RouterBias", "RouterThreshold",
           "update_router_bias", "grouped_matmul", "get_gmm", "resolve_backend", "BACKENDS",
           "GLUExperts", "routed_experts", "routed_experts_sharded", "routed_swiglu_experts",
           "ExpertParallelWarning"]

"""Mixture-of-experts FFN layer: routers, token dispatch, grouped matmuls, load balancing.

`MoEFFN` is the public layer; `gmm` the grouped matmul with per-platform backends (CPU
expert loop, Pallas GPU kernel, megablox on TPU, `ragged_dot`, dense reference);
`update_router_bias` the CMoE / DeepSeek-V3 balancing step; `routed_swiglu_experts` the routed
experts on one device or expert-parallel (all-to-all over a mesh's "expert" axis).

Example::

    from flax import nnx
    from cmoe_jax.moe import MoEFFN
    layer = MoEFFN(576, 192, 8, 2, shared_width=192, router="cmoe", rngs=nnx.Rngs(0))
"""
from cmoe_jax.moe.balance import RouterBias, update_router_bias
from cmoe_jax.moe.dispatch import routed_experts
from cmoe_jax.moe.expert_parallel import routed_experts_sharded, routed_swiglu_experts
from cmoe_jax.moe.gmm import BACKENDS, get_gmm, gmm, resolve_backend
from cmoe_jax.moe.layer import MoEFFN
from cmoe_jax.moe.routers import ROUTER_KINDS, RouterKind

__all__ = ["MoEFFN", "RouterKind", "ROUTER_KINDS", "RouterBias", "update_router_bias", "gmm",
           "get_gmm", "resolve_backend", "BACKENDS", "routed_experts", "routed_experts_sharded",
           "routed_swiglu_experts"]

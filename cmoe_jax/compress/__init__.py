"""ConMoE expert-pool consolidation (paper 004) and the pruning/merging baselines.

`compress` is the job behind `python -m cmoe_jax.compress`; the in-memory pieces are
`collect_stats` (calibration), `conmoe_plans` / `baseline_plans` (what to keep and where
each slot goes) and `apply_plans` (the prototype runtime) / `materialize` (the copied
checkpoint).
"""
from cmoe_jax.compress.baselines import baseline_plans
from cmoe_jax.compress.build import apply_plans, materialize, routed_bytes
from cmoe_jax.compress.calibration import LayerStats, collect_stats
from cmoe_jax.compress.plan import ScopePlan, conmoe_plans


def compress(*args, **kwargs):
    from cmoe_jax.compress.api import compress as _compress

    return _compress(*args, **kwargs)


__all__ = ["compress", "collect_stats", "LayerStats", "conmoe_plans", "baseline_plans",
           "ScopePlan", "apply_plans", "materialize", "routed_bytes"]

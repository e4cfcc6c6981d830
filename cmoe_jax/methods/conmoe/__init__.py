"""ConMoE expert-pool consolidation and the pruning/merging baselines it is compared with.

`collect_stats` (calibration), `conmoe_plans` / `baseline_plans` (what to keep and where
each slot goes), `apply_plans` (the prototype runtime) / `materialize` (a copied checkpoint).
"""
from cmoe_jax.methods.conmoe import baselines, scoring
from cmoe_jax.methods.conmoe.baselines import METHODS, baseline_plans
from cmoe_jax.methods.conmoe.build import apply_plans, materialize, routed_bytes
from cmoe_jax.methods.conmoe.calibration import LayerStats, collect_stats
from cmoe_jax.methods.conmoe.plan import ScopePlan, conmoe_plans
from cmoe_jax.methods.conmoe.report import write_report
from cmoe_jax.methods.conmoe.scoring import DISTANCES, SELECTIONS
from cmoe_jax.moe.prototypes import DUPLICATE_GATES

__all__ = ["baselines", "scoring", "baseline_plans", "apply_plans", "materialize", "routed_bytes",
           "LayerStats", "collect_stats", "ScopePlan", "conmoe_plans", "METHODS", "SELECTIONS",
           "DISTANCES", "DUPLICATE_GATES", "write_report"]

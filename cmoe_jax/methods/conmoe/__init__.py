"""ConMoE expert-pool consolidation and the pruning/merging baselines it is compared with.

`collect_stats` (calibration), `conmoe_plans` / `baseline_plans` (what to keep and where
each slot goes), `apply_plans` (the prototype runtime) / `materialize` (a copied checkpoint).
"""
from cmoe_jax.methods.conmoe import baselines, scoring
from cmoe_jax.methods.conmoe.baselines import METHODS, baseline_plans
from cmoe_jax.methods.conmoe.build import apply_plans, materialize, routed_bytes
from cmoe_jax.methods.conmoe.expert_stats import LayerStats, collect_stats
from cmoe_jax.methods.conmoe.plan import ScopePlan, conmoe_plans
from cmoe_jax.methods.conmoe.report import write_report
from cmoe_jax.methods.conmoe.scoring import DISTANCES, SELECTIONS
from cmoe_jax.moe.prototypes import DUPLICATE_GATES
from cmoe_jax.methods.conmoe.job import (METHODS as COMPRESS_METHODS, CompressConfig, CompressSettings,
                                         CompressSteps, check_inputs, make_plans)
from cmoe_jax.methods.conmoe import flags
from cmoe_jax.methods.method import Method

METHOD = Method(name="conmoe", command="compress", choices=COMPRESS_METHODS, title="ConMoE",
                summary="conmoe (expert-pool consolidation) or a baseline",
                settings=CompressSettings, steps=CompressSteps, add_flags=flags.add_flags,
                from_args=flags.settings_from_args, flag_choices=("conmoe",), single_process=True)

__all__ = ["baselines", "scoring", "baseline_plans", "apply_plans", "materialize", "routed_bytes",
           "LayerStats", "collect_stats", "ScopePlan", "conmoe_plans", "METHODS", "SELECTIONS",
           "DISTANCES", "DUPLICATE_GATES", "write_report", "COMPRESS_METHODS", "CompressConfig",
           "CompressSettings", "CompressSteps", "check_inputs", "make_plans", "flags", "METHOD"]

"""CMoE: carve each dense SwiGLU FFN into shared and routed experts with an analytical router.

`convert_model` converts a loaded model in memory; `convert_streamed` reads one layer at a
time from the checkpoint. `MoEPlan` is the SxAyEz configuration. `carve_ffn` carves one FFN
of your own (its weights and calibration inputs) into a filled `MoEFFN` in one call.
"""
from cmoe_jax.methods.cmoe.carve import LayerCarving, carve_layer, slice_ffn
from cmoe_jax.methods.cmoe.carve_ffn import carve_ffn
from cmoe_jax.methods.cmoe.convert import (ConversionError, ConvertConfig, LayerRecord, carve_profiled, check_router,
                                           conversion_mesh, convert_model)
from cmoe_jax.methods.cmoe.plan import MoEPlan
from cmoe_jax.methods.cmoe.report import layer_table, plot_expert_load, write_report
from cmoe_jax.methods.cmoe.budget import Budget, BudgetError, adaptive_config, measure_damage
from cmoe_jax.methods.cmoe.router import (gate_fit_sums, representative_neurons, router_fit_sums,
                                          router_weights, scale_router_up, solve_gate_scales)
from cmoe_jax.methods.cmoe.shared import split_shared
from cmoe_jax.methods.cmoe.streamed import Streamed, convert_streamed
from cmoe_jax.methods.cmoe.job import (CmoeSteps, ConvertSettings, base_manifest, check_context,
                                       is_dense, stage_seconds)
from cmoe_jax.methods.cmoe import flags
from cmoe_jax.methods.method import Method

METHOD = Method(name="cmoe", command="convert", choices=("cmoe",), title="CMoE",
                summary="cmoe (CMoE; hierarchical when --model is an MoE)",
                settings=ConvertSettings, steps=CmoeSteps, add_flags=flags.add_flags,
                from_args=flags.settings_from_args, check_args=flags.check_args, takes_source=is_dense)

__all__ = ["LayerCarving", "carve_layer", "slice_ffn", "ConversionError", "ConvertConfig",
           "LayerRecord", "convert_model", "MoEPlan", "representative_neurons", "router_weights",
           "split_shared", "layer_table", "Budget", "BudgetError", "adaptive_config", "measure_damage", "Streamed", "convert_streamed", "check_router", "conversion_mesh", "plot_expert_load",
           "write_report", "router_fit_sums", "scale_router_up", "gate_fit_sums", "solve_gate_scales", "carve_ffn", "carve_profiled", "CmoeSteps", "ConvertSettings",
           "base_manifest", "check_context", "is_dense", "stage_seconds", "flags", "METHOD"]

"""CMoE: carve each dense SwiGLU FFN into shared and routed experts with an analytical router.

`convert_model` converts a loaded model in memory; `convert_streamed` reads one layer at a
time from the checkpoint. `MoEPlan` is the SxAyEz configuration. `carve_ffn` carves one FFN
of your own (its weights and calibration inputs) into a filled `MoEFFN` in one call.

The package holds the carving names; the conversion job's live in their own modules
(`budget`, `streamed`, `report`, `settings`; `job`: the steps and `METHOD`, what the
registry reads), so
`from cmoe_jax import carve_ffn`, a library call, loads what carving one FFN needs and not
the job's checkpoint, dataset and GGUF libraries.
"""
from cmoe_jax.methods.cmoe.carve import LayerCarving, carve_layer, slice_ffn
from cmoe_jax.methods.cmoe.carve_ffn import carve_ffn
from cmoe_jax.methods.cmoe.config import ConversionError, ConvertConfig
from cmoe_jax.methods.cmoe.convert import (LayerRecord, carve_one_layer, carve_profiled, check_router, conversion_mesh,
                                           convert_model, moe_spec, slices_for)
from cmoe_jax.methods.cmoe.plan import MoEPlan
from cmoe_jax.methods.cmoe.layer_fit import LayerFits, fit_layer, fit_router_scales
from cmoe_jax.methods.cmoe.router import (gate_fit_sums, representative_neurons, router_fit_sums,
                                          router_weights, scale_router_up, solve_gate_scales)
from cmoe_jax.methods.cmoe.shared import split_shared

__all__ = ["LayerCarving", "carve_layer", "slice_ffn", "carve_ffn", "ConversionError", "ConvertConfig",
           "LayerRecord", "carve_one_layer", "carve_profiled", "check_router", "conversion_mesh", "convert_model",
           "moe_spec", "slices_for", "LayerFits", "fit_layer", "fit_router_scales", "MoEPlan",
           "gate_fit_sums", "representative_neurons", "router_fit_sums", "router_weights",
           "scale_router_up", "solve_gate_scales", "split_shared"]

"""Hierarchical CMoE: CMoE applied to every expert of an existing MoE model (sub-experts
behind a sub-router per expert), and the random-split baseline at the same active width."""
from cmoe_jax.methods.hierarchical.carve import ExpertCarving, carve_moe_layer, random_moe_layer
from cmoe_jax.methods.hierarchical.convert import (HierLayerRecord, convert_moe_model, hier_spec, is_moe,
                                                   manifest_fields, random_hierarchical, validate_moe,
                                                   build_hier_ffn)
from cmoe_jax.methods.hierarchical.report import write_hier_report
from cmoe_jax.methods.hierarchical.job import HierarchicalSteps
from cmoe_jax.methods.hierarchical import flags
from cmoe_jax.methods.cmoe.job import ConvertSettings
from cmoe_jax.methods.method import Method

# chosen by --method cmoe when the source is an MoE; the CMoE flags describe its settings
METHOD = Method(name="hierarchical", command="convert", choices=("cmoe",), title="hierarchical CMoE",
                summary="", settings=ConvertSettings, steps=HierarchicalSteps, add_flags=flags.add_flags,
                takes_source=is_moe)

__all__ = ["ExpertCarving", "carve_moe_layer", "random_moe_layer", "HierLayerRecord",
           "convert_moe_model", "hier_spec", "is_moe", "manifest_fields", "random_hierarchical",
           "validate_moe", "build_hier_ffn", "write_hier_report", "HierarchicalSteps", "flags", "METHOD"]

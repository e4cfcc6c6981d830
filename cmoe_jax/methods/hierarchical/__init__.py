"""Hierarchical CMoE: CMoE applied to every expert of an existing MoE model (sub-experts
behind a sub-router per expert), and the random-split baseline at the same active width."""
from cmoe_jax.methods.hierarchical.carve import ExpertCarving, carve_moe_layer, random_moe_layer
from cmoe_jax.methods.hierarchical.convert import (HierLayerRecord, convert_moe_model, hier_spec, is_moe,
                                                   manifest_fields, random_hierarchical, validate_moe)
from cmoe_jax.methods.hierarchical.report import write_hier_report

__all__ = ["ExpertCarving", "carve_moe_layer", "random_moe_layer", "HierLayerRecord",
           "convert_moe_model", "hier_spec", "is_moe", "manifest_fields", "random_hierarchical",
           "validate_moe", "write_hier_report"]

"""CMoE carving: configuration, activation markers, exact balanced K-means, expert slices.

Pure, model-independent functions; see carve.py for the top-level `carve_layer` and
`slice_ffn`.
"""
from cmoe_jax.carving.assignment import assignment_cost, balanced_assignment, repeated_column_reference
from cmoe_jax.carving.carve import LayerCarving, carve_layer, slice_ffn
from cmoe_jax.carving.kmeans import KMeansResult, balanced_kmeans, markers_to_points, squared_distances
from cmoe_jax.carving.markers import profile_layer
from cmoe_jax.carving.plan import MoEPlan
from cmoe_jax.carving.router import representative_neurons, router_weights
from cmoe_jax.carving.shared import split_shared

__all__ = ["assignment_cost", "balanced_assignment", "repeated_column_reference", "LayerCarving",
           "carve_layer", "slice_ffn", "KMeansResult", "balanced_kmeans", "markers_to_points",
           "squared_distances", "profile_layer", "MoEPlan", "representative_neurons",
           "router_weights", "split_shared"]

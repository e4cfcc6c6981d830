"""CMoE carving: configuration, activation markers, exact balanced K-means, expert slices."""
from cmoe_jax.carving.assignment import assignment_cost, balanced_assignment, repeated_column_reference
from cmoe_jax.carving.carve import LayerCarving, carve_layer, slice_ffn, top_mu
from cmoe_jax.carving.kmeans import KMeansResult, balanced_kmeans
from cmoe_jax.carving.markers import ffn_hidden, profile_markers
from cmoe_jax.carving.plan import MoEPlan

__all__ = ["assignment_cost", "balanced_assignment", "repeated_column_reference", "LayerCarving",
           "carve_layer", "slice_ffn", "top_mu", "KMeansResult", "balanced_kmeans", "ffn_hidden",
           "profile_markers", "MoEPlan"]

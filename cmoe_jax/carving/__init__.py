"""Shared carving algorithms: exact balanced assignment and balanced K-means.

Pure, model-independent functions that the methods (`cmoe_jax.methods.*`) build on.
"""
from cmoe_jax.carving.assignment import assignment_cost, balanced_assignment, repeated_column_reference
from cmoe_jax.carving.kmeans import KMeansResult, balanced_kmeans, markers_to_points, squared_distances

__all__ = ["assignment_cost", "balanced_assignment", "repeated_column_reference", "KMeansResult",
           "balanced_kmeans", "markers_to_points", "squared_distances"]

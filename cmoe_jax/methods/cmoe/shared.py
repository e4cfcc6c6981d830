"""Shared experts: the x*m neurons with the highest activation rates (the paper) or output energy."""
from __future__ import annotations

import numpy as np


def split_shared(mu, shared_width: int, routed: int, score=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(shared ids sorted, remaining ids sorted, initial centroid ids).

    Shared: the `shared_width` neurons of highest `score` (default: mu, the paper's rule).
    Initial centroids: the `routed` neurons of highest mu among the rest, in decreasing mu
    (cluster j starts at the j-th of them). Ties go to the lower id.
    """
    mu = np.asarray(mu, np.float64)
    if mu.ndim != 1:
        raise ValueError(f"mu must be [d_h], got shape {mu.shape}")
    score = mu if score is None else np.asarray(score, np.float64)
    if score.shape != mu.shape:
        raise ValueError(f"shared score has shape {score.shape}, mu has {mu.shape}")
    shared = np.sort(np.argsort(-score, kind="stable")[:shared_width])
    rest = np.setdiff1d(np.arange(len(mu)), shared)
    by_mu = rest[np.argsort(-mu[rest], kind="stable")]
    return shared, rest, by_mu[:routed]

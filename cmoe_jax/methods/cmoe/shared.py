"""Shared experts: the x*m neurons with the highest activation rates (the paper) or output energy."""
from __future__ import annotations

import numpy as np


def split_shared(mu, shared_width: int, routed: int, score=None, tie_score=None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(shared ids sorted, remaining ids sorted, initial centroid ids).

    Shared: the `shared_width` neurons of highest `score` (default: mu, the paper's rule).
    Initial centroids: the `routed` neurons of highest mu among the rest, in decreasing mu
    (cluster j starts at the j-th of them). Ties go to the higher `tie_score` (the pipeline
    passes output energies: in a layer where fewer neurons than the shared set ever reach a
    token's top K_a, the rest of the set is chosen among neurons of rate 0 by what they
    contribute, not by their ids), then to the lower id.
    """
    mu = np.asarray(mu, np.float64)
    if mu.ndim != 1:
        raise ValueError(f"mu must be [d_h], got shape {mu.shape}")
    score = mu if score is None else np.asarray(score, np.float64)
    tie = np.zeros_like(mu) if tie_score is None else np.asarray(tie_score, np.float64)
    if score.shape != mu.shape or tie.shape != mu.shape:
        raise ValueError(f"shared score {score.shape} and tie score {tie.shape} must match mu {mu.shape}")
    # lexsort: last key first; stable, so equal keys keep the lower id first
    shared = np.sort(np.lexsort((-tie, -score))[:shared_width])
    rest = np.setdiff1d(np.arange(len(mu)), shared)
    by_mu = rest[np.lexsort((-tie[rest], -mu[rest]))]
    return shared, rest, by_mu[:routed]

"""ConMoE's prototype scores, selection and slot reassignment (paper sec. 4, app. B.1).

Pure numpy on one scope G (S consecutive MoE layers, their experts numbered layer-major):
distance d (mean over gate/up/down of the normalised Frobenius distance), replaceability
b_e = min over the other experts of d, contribution a_e (from `calibration`), score
s_e = minmax(a)_e * minmax(b)_e, the top-K prototypes under one of the selection rules, and
the nearest-prototype map.
"""
from __future__ import annotations

import math

import numpy as np

EPS = 1e-8
SELECTIONS = ("adaptive", "fixed", "usage", "reap", "distance")
DISTANCES = ("weights", "outputs")  # d from the experts' weights (paper) or their mean outputs


def budget(n: int, ratio: float) -> int:
    """K = max(1, round((1 - rho) n)), rounding halves up (5 experts at 50%: 3)."""
    return max(1, int(math.floor((1.0 - ratio) * n + 0.5)))


def frobenius_distance(ws: list[np.ndarray], eps: float = EPS) -> np.ndarray:
    """`[n, n]` d(e, e') for projections `ws` (each `[n, ...]`, one row per expert), through
    Gram matrices in float64 (||A - B||^2 = ||A||^2 + ||B||^2 - 2 <A, B>)."""
    total = 0.0
    for w in ws:
        flat = np.asarray(w, np.float64).reshape(w.shape[0], -1)
        gram = flat @ flat.T
        sq = np.diag(gram)
        diff = np.sqrt(np.maximum(sq[:, None] + sq[None, :] - 2 * gram, 0.0))
        norm = np.sqrt(sq)
        total = total + 2 * diff / (norm[:, None] + norm[None, :] + 2 * eps)
    d = total / len(ws)
    np.fill_diagonal(d, 0.0)
    return d


def replaceability(dist: np.ndarray) -> np.ndarray:
    """b_e = min over e' != e of d(e, e') (0 for a scope of one expert)."""
    if dist.shape[0] < 2:
        return np.zeros(dist.shape[0])
    off = dist + np.diag(np.full(dist.shape[0], np.inf))
    return off.min(axis=1)


def minmax(x: np.ndarray, eps: float = EPS) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return (x - x.min()) / (x.max() - x.min() + eps)


def top(score: np.ndarray, k: int, among: np.ndarray | None = None) -> np.ndarray:
    """Indices of the k largest scores (ties: lower index first), optionally among a subset."""
    idx = np.arange(len(score)) if among is None else np.asarray(among)
    order = idx[np.lexsort((idx, -np.asarray(score)[idx]))]
    return np.sort(order[:k])


def select(contrib, dist, freq, layer_of, ratio: float, selection: str = "adaptive") -> dict:
    """Prototypes of one scope: `{"prototypes", "score", "a", "b", "K"}`.

    `layer_of [n]`: the layer (position in the scope) of each expert. "adaptive": top-K by
    s over the scope; "fixed": each layer keeps its own round((1 - rho) E_l) by s;
    "usage"/"reap"/"distance": top-K by frequency / a_e / b_e alone."""
    if selection not in SELECTIONS:
        raise ValueError(f"selection {selection!r} must be one of {', '.join(SELECTIONS)}")
    a, b = np.asarray(contrib, np.float64), replaceability(dist)
    s = minmax(a) * minmax(b)
    layer_of = np.asarray(layer_of)
    n = len(a)
    if selection == "fixed":
        protos = np.concatenate([top(s, budget(int((layer_of == l).sum()), ratio),
                                     np.flatnonzero(layer_of == l)) for l in np.unique(layer_of)])
    else:
        key = {"adaptive": s, "usage": np.asarray(freq, np.float64), "reap": a, "distance": b}[selection]
        protos = top(key, budget(n, ratio))
    return {"prototypes": np.sort(protos), "score": s, "a": a, "b": b, "K": len(protos)}


def assign(dist: np.ndarray, prototypes: np.ndarray) -> np.ndarray:
    """`[n]` index into `prototypes` of each expert's nearest prototype (a prototype maps to
    itself; ties: the lower index)."""
    prototypes = np.asarray(prototypes)
    nearest = np.argmin(dist[:, prototypes], axis=1)
    nearest[prototypes] = np.arange(len(prototypes))
    return nearest


def cross_layer_fraction(dist: np.ndarray, layer_of) -> float:
    """Share of experts whose nearest other expert of the scope lies in another layer."""
    layer_of = np.asarray(layer_of)
    if dist.shape[0] < 2:
        return 0.0
    off = dist + np.diag(np.full(dist.shape[0], np.inf))
    return float(np.mean(layer_of[np.argmin(off, axis=1)] != layer_of))

"""Per-layer budget allocation: which shape each layer gets so that the model's mean active
share meets a budget and the summed damage is smallest.

An exact multiple-choice knapsack by dynamic programming over integer share units (a shape
with k of z equal-width experts active costs k units), so the answer is optimal for the
measured damage, not a greedy approximation; L layers, K shapes and U units cost O(L K U).
"""
from __future__ import annotations

import numpy as np


class BudgetError(ValueError):
    """No choice of the candidate shapes meets the budget."""


def allocate(damage, units, target: int, preferred: int | None = None) -> list[int]:
    """Index of the chosen shape per layer: sum of units == `target`, least summed damage.

    damage [L, K]: each layer's damage under each candidate shape (inf: not allowed);
    units [K]: each shape's cost in integer share units. Among allocations of equal damage
    the one closest to `preferred` (a shape index, e.g. the uniform shape) in summed squared
    unit distance wins, so layers of equal sensitivity get the uniform shape.
    """
    damage = np.asarray(damage, np.float64)
    units = np.asarray(units, np.int64)
    layers, shapes = damage.shape
    if units.shape != (shapes,):
        raise ValueError(f"units {units.shape} do not match the {shapes} shapes of damage {damage.shape}")
    if not units.min() * layers <= target <= units.max() * layers:
        raise BudgetError(f"a budget of {target} units is out of reach of {layers} layers whose "
                          f"shapes cost {units.min()} to {units.max()} units each")
    home = 0 if preferred is None else int(units[preferred])
    # cost[u]: (least damage, least drift from `home`) of the layers so far using u units
    cost = np.full((target + 1, 2), np.inf)
    cost[0] = 0.0
    choice = np.zeros((layers, target + 1), np.int64)
    for layer in range(layers):
        best = np.full((target + 1, 2), np.inf)
        for k in range(shapes):
            u = int(units[k])
            if u > target or not np.isfinite(damage[layer, k]):
                continue
            cand = cost[:target + 1 - u] + [damage[layer, k], (u - home) ** 2 if preferred is not None else 0]
            better = _lexically_less(cand, best[u:])
            best[u:][better] = cand[better]
            choice[layer, u:][better] = k
        cost = best
    if not np.isfinite(cost[target, 0]):
        raise BudgetError(f"no choice of the candidate shapes spends exactly {target} units")
    picked, u = [], target
    for layer in reversed(range(layers)):
        k = int(choice[layer, u])
        picked.append(k)
        u -= int(units[k])
    return picked[::-1]


def _lexically_less(a, b):
    """Rows of a [n, 2] that are lexicographically smaller than those of b, with a tolerance
    on the first key so that float noise in equal damages does not hide the second key."""
    close = np.isclose(a[:, 0], b[:, 0], rtol=1e-9, atol=1e-15) | (np.isinf(a[:, 0]) & np.isinf(b[:, 0]))
    return np.where(close, a[:, 1] < b[:, 1], a[:, 0] < b[:, 0])

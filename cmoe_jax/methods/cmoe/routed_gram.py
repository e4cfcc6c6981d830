"""The down fit's normal equations with the routing's zeros skipped, on the host CPU.

The down fit's P [T, H] holds, for each routed expert, its neurons' gated activations only
on the tokens routed to it (`down_fit_sums`): at S3A3E8 a token feeds 6 of the 8 experts'
columns, at S1A1E8 2 of 8, so most of a dense P^T P multiplies zeros. Here P^T P is made one
block pair at a time over just the tokens both blocks are non-zero on: (S + k m)^2 rather
than H^2 multiply-adds a token (S3A3E8: 56%, S1A1E8: 6%). A token set varies in size, so
the blocks are numpy products (BLAS), for a conversion calibrating on the CPU; on an
accelerator the dense product (`symmetric_gram`) is the fast one.
"""
from __future__ import annotations

import numpy as np


def routed_normal_equations(dense: list, gated: np.ndarray, weight: np.ndarray, y: np.ndarray,
                            offsets: tuple) -> tuple[np.ndarray, np.ndarray]:
    """float32 (P^T P [H, H], P^T y [H, d]) of one window, P's columns laid out as
    `down_fit_sums` lays them: `dense` [(column offset, [T, w] activations)] (the shared
    MLP's, the skip term's; every token feeds them), `gated` [T, E, m] the experts'
    activations times their gates (0 on a token the expert skips), at column
    `offsets[0]`, expert j's block starting at offsets[0] + j m; `weight` [T, E] the gates
    (0: skipped); `y` [T, d] the dense FFN's output. `offsets[1]` is H. The matrix is
    exactly symmetric (each lower block the transpose of its upper one)."""
    start, h_all = offsets
    _, e, m = gated.shape
    routed = weight != 0
    rows = [np.flatnonzero(routed[:, j]) for j in range(e)]
    blocks = [np.ascontiguousarray(gated[r, j]) for j, r in enumerate(rows)]
    ptp = np.zeros((h_all, h_all), np.float32)
    pty = np.empty((h_all, y.shape[1]), np.float32)
    for i, (a, da) in enumerate(dense):
        pty[a:a + da.shape[1]] = da.T @ y
        for b, db in dense[i:]:
            _put(ptp, a, b, da.T @ db)
        for j, r in enumerate(rows):
            _put(ptp, a, start + j * m, da[r].T @ blocks[j])
    at = np.cumsum(routed, axis=0) - 1  # each token's row in every expert's block
    for j, r in enumerate(rows):
        a = start + j * m
        pty[a:a + m] = blocks[j].T @ y[r]
        for ll in range(j, e):
            both = routed[r, ll]
            if both.any():
                _put(ptp, a, start + ll * m, blocks[j][both].T @ blocks[ll][at[r[both], ll]])
    return ptp, pty


def _put(ptp: np.ndarray, a: int, b: int, block: np.ndarray) -> None:
    """Write the block at rows a, columns b and its transpose at the mirror; a diagonal
    block keeps its upper triangle on both sides."""
    rows, cols = block.shape
    if a == b:
        block = np.triu(block)
        block = block + np.triu(block, 1).T
    ptp[a:a + rows, b:b + cols] = block
    ptp[b:b + cols, a:a + rows] = block.T

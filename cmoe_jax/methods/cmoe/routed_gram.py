"""The down fit's normal equations with the routing's zeros skipped, on the host CPU.

The down fit's P [T, H] holds, for each routed expert, its neurons' gated activations only
on the tokens routed to it (`down_fit_sums`): at S3A3E8 a token feeds 6 of the 8 experts'
columns, at S1A1E8 2 of 8, so most of a dense P^T P multiplies zeros. Here the upper
triangle of P^T P (all `solve_down` reads) is made one block pair at a time over just the
tokens both blocks are non-zero on: about (S + k m)^2 / 2 rather than H^2 multiply-adds a
token. A token set varies in size, so the blocks are numpy products (BLAS), for a conversion
calibrating on the CPU; on an accelerator the dense product (`symmetric_gram`) is the fast one.
"""
from __future__ import annotations

import numpy as np


def routed_normal_equations(dense: list, gated: np.ndarray, weight: np.ndarray, y: np.ndarray,
                            offsets: tuple, out: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
    """float32 (P^T P [H, H] above the diagonal and on its diagonal blocks, 0 below them;
    P^T y [H, d])
    of one window, P's columns laid out as `down_fit_sums` lays them: `dense` [(column
    offset, [T, w] activations)] (the shared MLP's, the skip term's; every token feeds them),
    `gated` [T, E, m] the experts' activations times their gates (0 on a token the expert
    skips), expert j's block at column offsets[0] + j m; `weight` [T, E] the gates (0:
    skipped); `y` [T, d] the dense FFN's output. `offsets[1]` is H. `out`: the (P^T P, P^T y)
    of an earlier window of the same layout, overwritten (every block above the diagonal is
    written, so its zeros below stay): a window's 0.3 GB at H = 8,960 is not allocated and
    paged in again each time."""
    start, h_all = offsets
    _, e, m = gated.shape
    routed = weight != 0
    rows = [np.flatnonzero(routed[:, j]) for j in range(e)]
    blocks = [(start + j * m, np.ascontiguousarray(gated[r, j])) for j, r in enumerate(rows)]
    ptp, pty = out or (np.zeros((h_all, h_all), np.float32), np.empty((h_all, y.shape[1]), np.float32))
    for i, (a, da) in enumerate(dense):
        pty[a:a + da.shape[1]] = da.T @ y
        _gram(ptp, a, da)
        for b, db in dense[i + 1:]:
            _upper(ptp, a, b, da.T @ db)
        for r, (b, g) in zip(rows, blocks):
            _upper(ptp, a, b, da[r].T @ g)
    at = np.cumsum(routed, axis=0) - 1  # each token's row in every expert's block
    for j, (r, (a, g)) in enumerate(zip(rows, blocks)):
        pty[a:a + m] = g.T @ y[r]
        _gram(ptp, a, g)
        for ll in range(j + 1, e):
            both = routed[r, ll]
            _upper(ptp, a, blocks[ll][0], g[both].T @ blocks[ll][1][at[r[both], ll]])
    return ptp, pty


def _gram(ptp: np.ndarray, a: int, cols: np.ndarray) -> None:
    """cols^T cols into the diagonal block at a (whole: OpenBLAS's syrk, half the products,
    ran no faster than this product here)."""
    w = cols.shape[1]
    ptp[a:a + w, a:a + w] = cols.T @ cols


def _upper(ptp: np.ndarray, a: int, b: int, block: np.ndarray) -> None:
    """The block of rows a, columns b of a symmetric matrix, written where it is above the
    diagonal (transposed when b < a)."""
    rows, cols = block.shape
    if a < b:
        ptp[a:a + rows, b:b + cols] = block
    else:
        ptp[b:b + cols, a:a + rows] = block.T

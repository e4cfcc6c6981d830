"""Host buffers for loading and restoring: 64-byte aligned, filled in cache-sized tiles.

On a CPU backend `jax.device_put` adopts a numpy array whose data is 64-byte aligned instead
of copying it (numpy's own allocations are only 16-byte aligned), so a model loaded into
aligned buffers is held once, not twice, and skips a copy of every weight. A projection is
stored `[out, in]` in a checkpoint and `[in, out]` here: copying a transposed view in tiles
keeps both sides in cache, about three times faster than one strided copy of the whole
matrix.
"""
from __future__ import annotations

import numba
import numpy as np

ALIGNMENT = 64
_TILE = 64


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def is_aligned(a: np.ndarray) -> bool:
    return a.ctypes.data % ALIGNMENT == 0


@numba.njit(parallel=True, cache=True)
def _copy_tiles(dst, src):
    rows, cols = src.shape
    for t in numba.prange((rows + _TILE - 1) // _TILE):
        for j0 in range(0, cols, _TILE):
            for i in range(t * _TILE, min(rows, (t + 1) * _TILE)):
                for j in range(j0, min(cols, j0 + _TILE)):
                    dst[i, j] = src[i, j]


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """`dst[...] = src` (cast to dst's dtype), tile by tile when `src` is a strided 2-D view."""
    if src.ndim == 2 and not src.flags.c_contiguous and src.dtype == dst.dtype == np.float32:
        _copy_tiles(dst, src)
    else:
        np.copyto(dst, src, casting="unsafe")


def aligned_copy(src: np.ndarray, dtype) -> np.ndarray:
    """`src` as a C-contiguous, aligned array of `dtype`; `src` itself when it is one."""
    if src.dtype == np.dtype(dtype) and src.flags.c_contiguous and is_aligned(src):
        return src
    dst = aligned_empty(src.shape, dtype)
    copy_into(dst, src)
    return dst

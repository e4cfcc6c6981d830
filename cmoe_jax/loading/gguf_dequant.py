"""Dequantise GGUF tensors fast: compiled block kernels for the formats the project's models use.

The `gguf` package's numpy dequantisers are the reference, but they build several
temporaries per block group and run on one core: about 0.1 G values/s here, so a 1.5B
model's weights took half a minute to decode. These kernels decode each block straight into
the output, in parallel over blocks, with the same arithmetic in the same order (the results
are bit-identical to `gguf.quants.dequantize`; tests/test_gguf_dequant.py checks it). Formats
without a kernel go through the `gguf` package as before.

Block layouts (ggml's): Q8_0 `[d:f16, q:i8 x32]`; Q4_1 `[d:f16, m:f16, nibbles x16]`;
Q5_0 `[d:f16, high bits:u32, nibbles x16]`; Q4_K `[d:f16, dmin:f16, 6-bit scales and mins
x12 bytes, nibbles x128]` over 256 values in eight groups of 32; Q6_K `[low nibbles x128,
high 2-bit pairs x64, scales:i8 x16, d:f16]` over 256 values in sixteen groups of 16.
"""
from __future__ import annotations

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize

from cmoe_jax.host_arrays import aligned_empty


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as float32 (done in numpy: exact)."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16)[:, 0].astype(np.float32)


@numba.njit(parallel=True, cache=True)
def _q8_0(q, d, out):
    for b in numba.prange(q.shape[0]):
        for j in range(32):
            out[b, j] = np.float32(np.int8(q[b, 2 + j])) * d[b]


@numba.njit(parallel=True, cache=True)
def _q4_1(q, d, m, out):
    for b in numba.prange(q.shape[0]):
        for j in range(16):
            byte = np.int32(q[b, 4 + j])
            out[b, j] = d[b] * np.float32(byte & 15) + m[b]
            out[b, j + 16] = d[b] * np.float32(byte >> 4) + m[b]


@numba.njit(parallel=True, cache=True)
def _q5_0(q, d, out):
    for b in numba.prange(q.shape[0]):
        high = (np.uint32(q[b, 2]) | (np.uint32(q[b, 3]) << 8) | (np.uint32(q[b, 4]) << 16)
                | (np.uint32(q[b, 5]) << 24))
        for j in range(16):
            byte = np.int32(q[b, 6 + j])
            lo = ((byte & 15) | np.int32(((high >> j) & 1) << 4)) - 16
            hi = ((byte >> 4) | np.int32(((high >> (j + 16)) & 1) << 4)) - 16
            out[b, j] = d[b] * np.float32(lo)
            out[b, j + 16] = d[b] * np.float32(hi)


@numba.njit(parallel=True, cache=True)
def _q4_k(q, d, dmin, out):
    for b in numba.prange(q.shape[0]):
        for g in range(8):  # eight groups of 32 values, each with a 6-bit scale and min
            if g < 4:
                sc = np.int32(q[b, 4 + g]) & 63
                mn = np.int32(q[b, 8 + g]) & 63
            else:
                sc = (np.int32(q[b, 8 + g]) & 15) | ((np.int32(q[b, g]) >> 6) << 4)
                mn = (np.int32(q[b, 8 + g]) >> 4) | ((np.int32(q[b, 4 + g]) >> 6) << 4)
            scale = d[b] * np.float32(sc)
            shift = dmin[b] * np.float32(mn)
            half, bits = g // 2, 4 * (g % 2)
            for j in range(32):
                nib = (np.int32(q[b, 16 + 32 * half + j]) >> bits) & 15
                out[b, 32 * g + j] = scale * np.float32(nib) - shift


@numba.njit(parallel=True, cache=True)
def _q6_k(q, d, out):
    for b in numba.prange(q.shape[0]):
        for h in range(2):  # two halves of 128 values
            for g in range(4):  # four groups of 32: low or high nibbles, 2-bit pair g
                base = 128 * h + 32 * g
                for j in range(32):
                    low = np.int32(q[b, 64 * h + 32 * (g % 2) + j])
                    low = (low >> 4) if g >= 2 else (low & 15)
                    high = (np.int32(q[b, 128 + 32 * h + j]) >> (2 * g)) & 3
                    scale = d[b] * np.float32(np.int8(q[b, 192 + (base + j) // 16]))
                    out[b, base + j] = scale * np.float32((low | (high << 4)) - 32)


_KERNELS = {
    GGMLQuantizationType.Q8_0: lambda q, out: _q8_0(q, _f16(q, 0), out),
    GGMLQuantizationType.Q4_1: lambda q, out: _q4_1(q, _f16(q, 0), _f16(q, 2), out),
    GGMLQuantizationType.Q5_0: lambda q, out: _q5_0(q, _f16(q, 0), out),
    GGMLQuantizationType.Q4_K: lambda q, out: _q4_k(q, _f16(q, 0), _f16(q, 2), out),
    GGMLQuantizationType.Q6_K: lambda q, out: _q6_k(q, _f16(q, 208), out),
}


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`gguf.quants.dequantize(data, qtype)`, the same float32 values, into a 64-byte-aligned
    array (which `jax.device_put` on a CPU adopts without a copy)."""
    kernel = _KERNELS.get(qtype)
    if kernel is None:
        return np.asarray(_gguf_dequantize(data, qtype), dtype=np.float32)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.asarray(data).view(np.uint8)
    shape = (*raw.shape[:-1], raw.shape[-1] // type_size * block_size)
    blocks = raw.reshape(-1, type_size)
    out = aligned_empty(shape, np.float32)
    kernel(blocks, out.reshape(-1, block_size))
    return out

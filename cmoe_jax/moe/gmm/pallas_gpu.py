"""Grouped matmul for GPU: Pallas kernels lowered through Triton, with a custom VJP.

Rows are sorted by group. The forward kernel runs one program per (row tile, group) pair
that overlap ("visit", at most `tiles_m + G - 1` of them, computed on the host side of the
trace as in megablox) and per column tile; a tile that straddles two groups is visited
once per group and each visit stores only its own rows (masked store), so no row is
padded or dropped. The transposed kernel (`tgmm`, the weight gradient) runs one program
per (group, K tile, N tile) and loops over that group's row tiles with a data-dependent
trip count, masking rows of other groups. Operands are zero-padded to tile multiples in
the wrapper so every load is in bounds, which keeps `interpret=True` (CPU tests)
bit-for-bit the same program as the compiled one.

Both `pallas_call`s pass `plgpu.CompilerParams` (Triton): in jax 0.10.2 a call without
compiler params follows the global `jax_pallas_use_mosaic_gpu` flag (default: Mosaic GPU),
which these kernels are not written for. Tiles default per dtype (`default_tiles`), warps
and pipeline stages follow the tile (`launch_params`). fp32 products use the caller's
`precision` ("highest": IEEE fp32, the default, matches the CPU backends; "tf32";
"bf16x3": three bf16 products); bf16/fp16 inputs run on tensor cores and accumulate in fp32.

Lowering for CUDA is tested on CPU with `jax.export` (tests/test_gmm_lowering.py); the compiled
kernels are checked on a GPU by `benchmarks/gpu_check.py` (docs/results/performance.md).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from cmoe_jax.moe.gmm.vjp import differentiable_gmm

# the Triton dot moved from `pallas` to `pallas.triton` in jax 0.10.2 (same signature)
_dot = getattr(plgpu, "dot", None) or pl.dot

PRECISIONS = {
    "highest": jax.lax.Precision.HIGHEST,
    "tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
    "bf16x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
}
SMEM_BUDGET = 96 * 1024  # bytes of shared memory the pipeline may fill (fits A100/H100 and 100 KB parts)


def default_tiles(dtype) -> tuple[int, int, int]:
    """(tm, tk, tn): 128x64x128 for 16-bit inputs (tensor cores), 64x32x128 for fp32."""
    return (128, 64, 128) if jnp.dtype(dtype).itemsize == 2 else (64, 32, 128)


def launch_params(tiles, dtype, launch=None) -> plgpu.CompilerParams:
    """Triton launch: 8 warps for 128x128 output tiles (4 below), as many pipeline stages
    (2..4) as fit `SMEM_BUDGET` with one lhs and one rhs tile per stage; `launch`
    (num_warps, num_stages) overrides both (benchmarks/moe_breakdown.py's sweep)."""
    if launch is not None:
        return plgpu.CompilerParams(num_warps=launch[0], num_stages=launch[1])
    tm, tk, tn = tiles
    stage_bytes = (tm * tk + tk * tn) * jnp.dtype(dtype).itemsize
    return plgpu.CompilerParams(num_warps=8 if tm * tn >= 128 * 128 else 4,
                                num_stages=max(2, min(4, SMEM_BUDGET // stage_bytes)))


def _dot_precision(dtype, precision: str):
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {tuple(PRECISIONS)}")
    return PRECISIONS[precision] if jnp.dtype(dtype) == jnp.float32 else None


def _round_up(x: int, t: int) -> int:
    return -(-x // t) * t


def _pad_to(a, shape):
    return jnp.pad(a, [(0, s - d) for d, s in zip(a.shape, shape)])


def _group_bounds(group_sizes):
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    # one extra, empty group: invalid visits point at it and store nothing
    zero = jnp.zeros((1,), jnp.int32)
    return jnp.concatenate([starts, zero]), jnp.concatenate([ends, zero])


def _visits(group_sizes, tiles_m: int, tm: int):
    """(group id, row tile id) per program; padding visits get group G (empty)."""
    num_groups = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // tm
    count = jnp.where(sizes > 0, (ends + tm - 1) // tm - first, 0)
    cum = jnp.cumsum(count)
    v = jnp.arange(tiles_m + num_groups - 1, dtype=jnp.int32)
    g = jnp.searchsorted(cum, v, side="right").astype(jnp.int32)
    gc = jnp.minimum(g, num_groups - 1)
    tile = jnp.where(g < num_groups, first[gc] + v - (cum[gc] - count[gc]), 0)
    return g, tile


def _gmm_kernel(vg_ref, vt_ref, start_ref, end_ref, lhs_ref, rhs_ref, _zeros_ref, out_ref, *,
                tm, tk, tn, kp, num_groups, precision):
    v, j = pl.program_id(0), pl.program_id(1)
    g = vg_ref[v]
    t = vt_ref[v]
    lo, hi = start_ref[g], end_ref[g]
    gw = jnp.minimum(g, num_groups - 1)
    rows = pl.ds(t * tm, tm)
    cols = pl.ds(j * tn, tn)

    def body(kk, acc):
        a = plgpu.load(lhs_ref.at[rows, pl.ds(kk * tk, tk)])
        b = plgpu.load(rhs_ref.at[pl.ds(gw * kp + kk * tk, tk), cols])
        return acc + _dot(a, b, precision=precision)

    acc = jax.lax.fori_loop(0, kp // tk, body, jnp.zeros((tm, tn), jnp.float32))
    r = t * tm + jnp.arange(tm)
    mask = ((r >= lo) & (r < hi))[:, None]
    plgpu.store(out_ref.at[rows, cols], acc.astype(out_ref.dtype), mask=mask)


def _tgmm_kernel(start_ref, end_ref, lhs_ref, rhs_ref, out_ref, *, tm, tk, tn, kp, precision):
    g, kk, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = start_ref[g], end_ref[g]
    ks, cols = pl.ds(kk * tk, tk), pl.ds(j * tn, tn)

    def body(t, acc):
        rows = pl.ds(t * tm, tm)
        r = t * tm + jnp.arange(tm)
        keep = ((r >= lo) & (r < hi))[:, None]
        a = plgpu.load(lhs_ref.at[rows, ks])
        a = jnp.where(keep, a, jnp.zeros((), a.dtype))
        b = plgpu.load(rhs_ref.at[rows, cols])
        return acc + _dot(a, b, trans_a=True, precision=precision)

    first = lo // tm
    last = jnp.where(hi > lo, (hi + tm - 1) // tm, first)
    acc = jax.lax.fori_loop(first, last, body, jnp.zeros((tk, tn), jnp.float32))
    plgpu.store(out_ref.at[pl.ds(g * kp + kk * tk, tk), cols], acc.astype(out_ref.dtype))


def gmm_impl(lhs, rhs, group_sizes, transpose_rhs=False, *, tiles=None, precision="highest",
             interpret=False, launch=None):
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    tiles = tiles or default_tiles(lhs.dtype)
    tm, tk, tn = tiles
    m, k = lhs.shape
    num_groups, _, n = rhs.shape
    mp, kp, np_ = _round_up(m, tm), _round_up(k, tk), _round_up(n, tn)
    lhs_p = _pad_to(lhs, (mp, kp))
    rhs_p = _pad_to(rhs, (num_groups, kp, np_)).reshape(num_groups * kp, np_)
    vg, vt = _visits(group_sizes, mp // tm, tm)
    starts, ends = _group_bounds(group_sizes)
    kernel = functools.partial(_gmm_kernel, tm=tm, tk=tk, tn=tn, kp=kp, num_groups=num_groups,
                               precision=_dot_precision(lhs.dtype, precision))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), lhs.dtype),
        grid=(vg.shape[0], np_ // tn),
        input_output_aliases={6: 0},  # rows of no group stay zero
        compiler_params=launch_params(tiles, lhs.dtype, launch=launch),
        interpret=interpret,
        name="cmoe_gmm",
    )(vg, vt, starts, ends, lhs_p, rhs_p, jnp.zeros((mp, np_), lhs.dtype))
    return out[:m, :n]


def tgmm_impl(lhs, rhs, group_sizes, *, tiles=None, precision="highest", interpret=False):
    tiles = tiles or default_tiles(lhs.dtype)
    tm, tk, tn = tiles
    m, k = lhs.shape
    n = rhs.shape[1]
    num_groups = group_sizes.shape[0]
    mp, kp, np_ = _round_up(m, tm), _round_up(k, tk), _round_up(n, tn)
    starts, ends = _group_bounds(group_sizes)
    kernel = functools.partial(_tgmm_kernel, tm=tm, tk=tk, tn=tn, kp=kp,
                               precision=_dot_precision(lhs.dtype, precision))
    out_dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_groups * kp, np_), out_dtype),
        grid=(num_groups, kp // tk, np_ // tn),
        compiler_params=launch_params(tiles, lhs.dtype),
        interpret=interpret,
        name="cmoe_tgmm",
    )(starts, ends, _pad_to(lhs, (mp, kp)), _pad_to(rhs, (mp, np_)))
    return out.reshape(num_groups, kp, np_)[:, :k, :n]


def make_gmm(tiles=None, interpret: bool = False, precision: str = "highest"):
    """A differentiable Pallas grouped matmul.

    `tiles` (tm, tk, tn), powers of two >= 16 (None: `default_tiles` of the input dtype);
    `precision` of fp32 products, one of `PRECISIONS`; `interpret=True` runs on CPU (tests).
    """
    _dot_precision(jnp.float32, precision)  # fail early on a typo
    kw = dict(tiles=tiles, precision=precision, interpret=interpret)
    return differentiable_gmm(functools.partial(gmm_impl, **kw),
                              functools.partial(tgmm_impl, **kw))


gmm = make_gmm()

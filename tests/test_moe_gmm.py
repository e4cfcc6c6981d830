"""Every grouped-matmul backend against a per-group numpy loop and jax.lax.ragged_dot.

The GPU (Pallas/Triton) and TPU (megablox) kernels run in Pallas interpret mode on CPU.
"""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from cmoe_jax.moe.gmm import cpu as gmm_cpu, pallas_gpu as gmm_pallas_gpu, tpu as gmm_tpu
from cmoe_jax.moe.gmm import gmm_dense, gmm_ragged_dot, get_gmm, resolve_backend

HI = jax.lax.Precision.HIGHEST

BACKENDS = {
    "cpu": gmm_cpu.gmm,
    "cpu_small_blocks": gmm_cpu.make_gmm(windows=(16, 8, 4)),  # every window level
    "pallas_gpu_interpret": gmm_pallas_gpu.make_gmm((16, 16, 16), interpret=True),
    "megablox_tpu_interpret": gmm_tpu.make_gmm((16, 16, 16), interpret=True),
    "ragged_dot": gmm_ragged_dot,
    "dense": gmm_dense,
}

# (group sizes, rows): empty groups first, middle and last, rows past the groups' sum
CASES = [([13, 0, 30, 5], 48), ([0, 0, 41, 0, 9], 50), ([7, 20, 0], 30), ([3, 0, 12, 0], 20),
         ([64, 1, 0, 35], 100)]


def numpy_gmm(lhs, rhs, sizes):
    out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float64)
    start = 0
    for g, n in enumerate(sizes):
        for r in range(start, start + n):
            out[r] = lhs[r].astype(np.float64) @ rhs[g].astype(np.float64)
        start += n
    return out


def data(sizes, m, k=20, n=24, seed=0):
    rng = np.random.default_rng(seed)
    lhs = rng.normal(size=(m, k)).astype(np.float32)
    rhs = rng.normal(size=(len(sizes), k, n)).astype(np.float32)
    return lhs, rhs, np.asarray(sizes, np.int32)


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize("sizes,m", CASES)
def test_forward_matches_numpy_and_ragged_dot(name, sizes, m):
    lhs, rhs, gs = data(sizes, m + 2)  # two rows outside every group
    out = np.asarray(BACKENDS[name](jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(gs)))
    np.testing.assert_allclose(out, numpy_gmm(lhs, rhs, gs), rtol=1e-5, atol=1e-4)
    ref = jax.lax.ragged_dot(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(gs), precision=HI)
    np.testing.assert_allclose(out, np.asarray(ref), rtol=1e-5, atol=1e-4)
    assert np.all(out[m:] == 0)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_transposed_rhs(name):
    lhs, rhs, gs = data([10, 0, 22], 32)
    rhs_t = np.swapaxes(rhs, 1, 2).copy()
    out = BACKENDS[name](jnp.asarray(lhs), jnp.asarray(rhs_t), jnp.asarray(gs), True)
    np.testing.assert_allclose(np.asarray(out), numpy_gmm(lhs, rhs, gs), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize("sizes,m", CASES[:3])
def test_gradients_match_ragged_dot(name, sizes, m):
    lhs, rhs, gs = data(sizes, m, seed=1)
    cot = np.random.default_rng(2).normal(size=(m, rhs.shape[2])).astype(np.float32)
    fn = BACKENDS[name]

    def loss(f, a, b):
        return jnp.sum(f(a, b) * cot)

    got = jax.grad(lambda a, b: loss(lambda x, y: fn(x, y, jnp.asarray(gs)), a, b),
                   argnums=(0, 1))(jnp.asarray(lhs), jnp.asarray(rhs))
    want = jax.grad(lambda a, b: loss(
        lambda x, y: jax.lax.ragged_dot(x, y, jnp.asarray(gs), precision=HI), a, b),
        argnums=(0, 1))(jnp.asarray(lhs), jnp.asarray(rhs))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=2e-4)
    # numpy: d rhs[g] = lhs[rows g]^T cot[rows g]; empty groups get exactly zero
    start = 0
    for g, n in enumerate(gs):
        want_g = lhs[start:start + n].T.astype(np.float64) @ cot[start:start + n]
        np.testing.assert_allclose(np.asarray(got[1][g]), want_g, rtol=1e-5, atol=2e-4)
        if n == 0:
            assert np.all(np.asarray(got[1][g]) == 0)
        start += n


@pytest.mark.parametrize("impl", [
    lambda a, b, s: gmm_cpu.tgmm_impl(a, b, s, windows=(16, 8, 4)),
    lambda a, b, s: gmm_pallas_gpu.tgmm_impl(a, b, s, tiles=(16, 16, 16), interpret=True),
    lambda a, b, s: gmm_tpu.tgmm_impl(a, b, s, tiling=(16, 16, 16), interpret=True),
], ids=["cpu", "pallas_gpu", "megablox_tpu"])
def test_tgmm(impl):
    rng = np.random.default_rng(3)
    gs = np.array([0, 37, 5, 0, 20], np.int32)
    lhs = rng.normal(size=(64, 12)).astype(np.float32)
    rhs = rng.normal(size=(64, 18)).astype(np.float32)
    out = np.asarray(impl(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(gs)))
    start = 0
    for g, n in enumerate(gs):
        want = lhs[start:start + n].T.astype(np.float64) @ rhs[start:start + n]
        np.testing.assert_allclose(out[g], want, rtol=1e-5, atol=1e-4)
        start += n


def test_bf16_cpu_matches_ragged_dot():
    lhs, rhs, gs = data([30, 0, 34], 64)
    a, b = jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16)
    out = gmm_cpu.gmm(a, b, jnp.asarray(gs))
    assert out.dtype == jnp.bfloat16
    ref = gmm_ragged_dot(a, b, jnp.asarray(gs))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype,precision,tol", [(jnp.bfloat16, "highest", 2e-2),
                                                   (jnp.float32, "bf16x3", 1e-4)])
def test_pallas_gpu_interpret_precisions_match_ragged_dot(dtype, precision, tol):
    """bf16 inputs (fp32 accumulation) and fp32 via three bf16 products, at 32x32x32 tiles."""
    lhs, rhs, gs = data([30, 0, 34], 70, k=40, n=36)
    a, b = jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)
    fn = gmm_pallas_gpu.make_gmm((32, 32, 32), interpret=True, precision=precision)
    out = fn(a, b, jnp.asarray(gs))
    assert out.dtype == dtype
    ref = jax.lax.ragged_dot(a, b, jnp.asarray(gs), precision=HI, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref.astype(dtype), np.float32),
                               rtol=tol, atol=tol)


def test_backend_selection():
    assert resolve_backend("auto") == {"cpu": "cpu", "gpu": "pallas_gpu",
                                       "tpu": "megablox_tpu"}[jax.default_backend()]
    assert get_gmm("cpu") is gmm_cpu.gmm
    assert get_gmm(gmm_dense) is gmm_dense
    with pytest.raises(ValueError, match="unknown gmm backend"):
        resolve_backend("cuda_magic")


def test_cpu_gmm_under_jit_with_traced_sizes():
    lhs, rhs, gs = data([5, 0, 27], 32)
    f = jax.jit(gmm_cpu.gmm)
    for sizes in ([5, 0, 27], [0, 32, 0], [32, 0, 0]):
        sizes = np.asarray(sizes, np.int32)
        np.testing.assert_allclose(np.asarray(f(lhs, rhs, sizes)), numpy_gmm(lhs, rhs, sizes),
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sizes,m", CASES)
def test_cpu_fused_glu_equals_gather_and_two_ragged_dots(sizes, m, dtype):
    """`gmm_cpu.glu` (gather + gate + up + activation in one pass) against the unfused form
    on `jax.lax.ragged_dot`, values and gradients; rows past the groups give zeros."""
    rng = np.random.default_rng(len(sizes) + m)
    x = jnp.asarray(rng.standard_normal((11, 20)), dtype)
    src = jnp.asarray(rng.integers(0, 11, m), jnp.int32)
    wg, wu = (jnp.asarray(rng.standard_normal((len(sizes), 20, 24)) / 4, dtype) for _ in range(2))
    gs = jnp.asarray(sizes, jnp.int32)

    def ref(x, wg, wu):
        rows = x[src]
        mm = lambda w: jax.lax.ragged_dot(rows, w, gs, precision=HI,  # noqa: E731
                                          preferred_element_type=jnp.float32).astype(dtype)
        return jax.nn.silu(mm(wg)) * mm(wu)

    fused = lambda x, wg, wu: gmm_cpu.glu(x, src, wg, wu, gs, jax.nn.silu)  # noqa: E731
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    got, want = fused(x, wg, wu), ref(x, wg, wu)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    assert not np.asarray(got[sum(sizes):], np.float32).any()
    if dtype == jnp.float32:
        loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
        for a, b in zip(jax.grad(loss(fused), (0, 1, 2))(x, wg, wu), jax.grad(loss(ref), (0, 1, 2))(x, wg, wu)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

"""The grouped-matmul backend chooser: one place (`resolve_backend`), a fallback chain with a
warning instead of a failure at the first call, and the optional tokamax backend against
the CPU backend (forward and gradients, alone and inside `MoEFFN`)."""
import importlib.util

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

import cmoe_jax.moe.gmm as gmm_pkg
from cmoe_jax.moe import MoEFFN
from cmoe_jax.moe.gmm import BackendFallbackWarning, get_gmm, resolve_backend


@pytest.fixture(autouse=True)
def fresh_choice():
    gmm_pkg._resolve.cache_clear()
    yield
    gmm_pkg._resolve.cache_clear()


@pytest.mark.parametrize("name", ["pallas_gpu", "megablox_tpu"])
def test_a_backend_this_platform_cannot_run_falls_back_with_a_warning(name):
    with pytest.warns(BackendFallbackWarning, match=rf"{name}.*needs a .PU.*using 'cpu'"):
        assert resolve_backend(name) == "cpu"
    layer = MoEFFN(d_model=8, expert_width=4, num_experts=4, top_k=2, backend=name, activation="silu", rngs=nnx.Rngs(0))  # runs instead of raising
    assert layer(jnp.ones((6, 8))).shape == (6, 8)


def test_a_missing_tokamax_falls_back(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "tokamax" else real(n, *a))
    with pytest.warns(BackendFallbackWarning, match="tokamax is not installed"):
        assert resolve_backend("tokamax") == "cpu"


def test_auto_and_runnable_names_resolve_quietly():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", BackendFallbackWarning)
        assert resolve_backend("auto") == "cpu"
        assert resolve_backend("ragged_dot") == "ragged_dot" and resolve_backend("dense") == "dense"
    with pytest.raises(ValueError, match="unknown gmm backend 'cuda'"):
        resolve_backend("cuda")


def test_tokamax_equals_the_cpu_backend():
    pytest.importorskip("tokamax", reason="the optional extra `tokamax` is not installed")
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.normal(size=(23, 8)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(4, 8, 6)), jnp.float32)
    sizes = jnp.asarray([5, 0, 9, 6], jnp.int32)  # 3 rows past the groups: zeros
    tok, cpu = get_gmm("tokamax"), get_gmm("cpu")
    np.testing.assert_allclose(tok(lhs, rhs, sizes), cpu(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
    rhs_t = jnp.swapaxes(rhs, 1, 2)
    np.testing.assert_allclose(tok(lhs, rhs_t, sizes, True), cpu(lhs, rhs_t, sizes, True),
                               rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b, sizes)))
    for g_tok, g_cpu in zip(jax.grad(loss(tok), (0, 1))(lhs, rhs), jax.grad(loss(cpu), (0, 1))(lhs, rhs)):
        np.testing.assert_allclose(g_tok, g_cpu, rtol=1e-4, atol=1e-5)
    layers = {b: MoEFFN(d_model=8, expert_width=6, num_experts=4, top_k=2, shared_width=4, backend=b, activation="silu", rngs=nnx.Rngs(1)) for b in ("tokamax", "cpu")}
    x = jnp.asarray(rng.normal(size=(3, 7, 8)), jnp.float32)
    np.testing.assert_allclose(layers["tokamax"](x), layers["cpu"](x), rtol=1e-5, atol=1e-5)

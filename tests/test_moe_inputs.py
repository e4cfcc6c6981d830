"""The MoE layer as a library: bad input refused on every backend, zero tokens, the opt-in
router outputs and losses against a numpy recomputation, kernel_init, a default router that
trains, a light import and the grouped-matmul subpackage importable by name."""
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from cmoe_jax.moe import HierMoEFFN, MoEFFN, RouterOutput
from tests import moe_numpy

from conftest import xla_flags

D, M, E = 16, 8, 6
BACKENDS = ["cpu", "dense", "ragged_dot"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def layer_of(kind, backend="cpu", **kw):
    if kind == "hier":
        return HierMoEFFN(d_model=D, expert_width=4, num_experts=4, top_k=2, sub_experts=4, sub_shared=1, sub_top_k=2, shared_width=8,
                          backend=backend, activation="silu", rngs=nnx.Rngs(0), **kw)
    router, top_k = kind
    return MoEFFN(d_model=D, expert_width=M, num_experts=E, top_k=top_k, shared_width=8, router=router, backend=backend,
                  activation="silu", rngs=nnx.Rngs(0), **kw)


KINDS = [("linear", 2), ("cmoe", 2), ("topsum", 3), ("sum", E), "hier"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_wrong_width_is_refused_naming_both(kind, backend):
    layer = layer_of(kind, backend)
    for width in (12, 32):  # 12 * 4 tokens would regroup into 3 tokens of 16
        with pytest.raises(ValueError, match=rf"d_model={D}\b.*\b{width}\b"):
            layer(jnp.ones((4, width)))
    with pytest.raises(ValueError, match=rf"d_model={D}"):  # also when traced under jit
        nnx.jit(lambda m, x: m(x))(layer, jnp.ones((2, 3, 20)))


@pytest.mark.parametrize("bad", [jnp.ones((4, D), jnp.int32), jnp.float32(1.0), [1.0] * D])
def test_non_float_or_shapeless_input_is_refused(bad):
    with pytest.raises(ValueError, match="MoEFFN"):
        layer_of(("linear", 2))(bad)


def test_route_wants_flattened_tokens():
    with pytest.raises(ValueError, match=r"\[T, d_model=16\]"):
        layer_of(("linear", 2)).route(jnp.ones((2, 3, D)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(0, D), (2, 0, D), (0, 5, D)])
def test_zero_tokens_give_an_empty_output(kind, backend, shape):
    layer = layer_of(kind, backend)
    y, load, router = layer(jnp.ones(shape), return_load=True, return_router=True)
    assert y.shape == shape and y.dtype == jnp.float32
    assert int(load.sum()) == 0 and load.dtype == jnp.int32
    n = layer.top_experts if kind == "hier" else E
    assert router.logits.shape == shape[:-1] + (n,) and router.probs.shape == shape[:-1] + (n,)
    assert float(router.aux_loss) == 0.0 and float(router.z_loss) == 0.0
    assert nnx.jit(lambda m, x: m(x))(layer, jnp.ones(shape)).shape == shape


def scrambled(layer, seed=1):
    """Weights larger than the init (distinct routing), random u and bias for cmoe."""
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
        var.set_value(jnp.asarray(rng.normal(size=var.shape) * 0.5, jnp.float32))
    if layer.router == "cmoe":
        layer.router_bias[...] = jnp.asarray(rng.normal(size=layer.router_bias.shape) * 0.05)
    return layer


@pytest.mark.parametrize("kind", KINDS[:4])
def test_router_outputs_match_a_numpy_recomputation(kind):
    layer = scrambled(layer_of(kind))
    x = jax.random.normal(jax.random.PRNGKey(2), (3, 5, D))
    y, r = layer(x, return_router=True)
    assert isinstance(r, RouterOutput)
    flat = np.asarray(x, np.float64).reshape(-1, D)
    want_y, want_load, _ = moe_numpy.forward(layer, flat)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D), want_y, rtol=2e-4, atol=2e-4)
    p = moe_numpy.params(layer)
    logits = np.stack([moe_numpy.logits(p, xt, layer.router, E) for xt in flat])
    probs = np.stack([moe_numpy.softmax(z) for z in logits])
    np.testing.assert_allclose(np.asarray(r.logits).reshape(-1, E), logits, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(r.probs).reshape(-1, E), probs, rtol=1e-4, atol=1e-6)
    assert r.logits.shape == (3, 5, E)
    np.testing.assert_array_equal(np.asarray(r.load), want_load)
    frac = want_load / want_load.sum()
    np.testing.assert_allclose(float(r.aux_loss), E * np.sum(frac * probs.mean(0)), rtol=1e-5)
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    np.testing.assert_allclose(float(r.z_loss), np.mean(lse ** 2), rtol=1e-5)
    # the same outputs with the loads too, and the plain forward unchanged
    y2, load, r2 = layer(x, return_load=True, return_router=True)
    np.testing.assert_array_equal(np.asarray(load), want_load)
    np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(r2.z_loss), np.asarray(r.z_loss))


def test_hierarchical_router_outputs_are_the_top_level_routers():
    layer = layer_of("hier")
    x = jax.random.normal(jax.random.PRNGKey(3), (7, D))
    _, r = layer(x, return_router=True)
    logits = np.asarray(x, np.float64) @ np.asarray(layer.router_kernel[...], np.float64)
    np.testing.assert_allclose(np.asarray(r.logits), logits, rtol=1e-4, atol=1e-5)
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :2]
    np.testing.assert_array_equal(np.asarray(r.load), np.bincount(ids.ravel(), minlength=4))


def test_sown_router_outputs_equal_the_returned_ones():
    """Collected the way the guide shows (`nnx.capture`, also under `nnx.jit`), without
    Flax's deprecation of sowing outside a capture."""
    layer = scrambled(layer_of(("linear", 2), sow_router=True))
    x = jax.random.normal(jax.random.PRNGKey(4), (6, D))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        (_, r), _ = nnx.capture(lambda m, x: m(x, return_router=True), nnx.Intermediate)(layer, x)
        y, sown = nnx.capture(layer, nnx.Intermediate)(x)
        y_jit, sown_jit = nnx.jit(lambda m, x: nnx.capture(m, nnx.Intermediate)(x))(layer, x)
    for got in (sown, sown_jit):
        (outputs,) = got["router_outputs"].get_value()  # one call, one RouterOutput
        for a, b in zip(outputs, r, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(y_jit), np.asarray(y), rtol=1e-6, atol=1e-7)
    assert not nnx.state(layer, nnx.Intermediate)  # nothing left behind in the layer


def test_losses_train_the_router():
    """The Switch and z losses have finite, non-zero gradients for the router weights."""
    layer = scrambled(layer_of(("linear", 2)))
    x = jax.random.normal(jax.random.PRNGKey(5), (32, D))

    def loss(m):
        _, r = m(x, return_router=True)
        return r.aux_loss + 1e-3 * r.z_loss

    g = nnx.grad(loss)(layer)
    kernel = np.asarray(g["router_kernel"][...])
    assert np.isfinite(kernel).all() and np.abs(kernel).max() > 0


def test_the_default_router_trains_from_scratch_and_a_fresh_cmoe_router_does_not():
    x = jax.random.normal(jax.random.PRNGKey(6), (16, D))
    loss = lambda m: jnp.sum(m(x) ** 2)
    fresh = MoEFFN(d_model=D, expert_width=M, num_experts=E, top_k=2, activation="silu", rngs=nnx.Rngs(0))
    assert fresh.router == "linear"
    assert np.abs(np.asarray(nnx.grad(loss)(fresh)["router_kernel"][...])).max() > 0
    cmoe = MoEFFN(d_model=D, expert_width=M, num_experts=E, top_k=2, router="cmoe", activation="silu", rngs=nnx.Rngs(0))  # u = 0: gates are 1
    g = nnx.grad(loss)(cmoe)
    assert np.abs(np.asarray(g["router_gate"][...])).max() == 0
    assert np.abs(np.asarray(g["u"][...])).max() > 0  # ... until u moves


def test_kernel_init_sees_each_matrix_in_its_in_out_shape():
    shapes = []

    def init(key, shape, dtype):
        shapes.append(tuple(shape))
        return jnp.full(shape, shape[0], dtype) + jax.random.normal(key, shape, dtype) * 0

    layer = MoEFFN(d_model=D, expert_width=M, num_experts=E, top_k=2, shared_width=8, kernel_init=init, activation="silu", rngs=nnx.Rngs(0))
    assert set(shapes) == {(D, 8), (8, D), (D, M), (M, D), (D, E)}
    assert float(layer.expert_gate[...][3, 0, 0]) == D and float(layer.expert_down[...][1, 0, 0]) == M
    lecun = MoEFFN(d_model=64, expert_width=32, num_experts=4, top_k=2, kernel_init=nnx.initializers.lecun_normal(), activation="silu", rngs=nnx.Rngs(0))
    std = float(jnp.std(lecun.expert_gate[...]))
    assert abs(std - 64 ** -0.5) < 0.15 * 64 ** -0.5, std  # fan-in d, not d * E


def test_scale_router_up_returns_the_scaled_weights_and_the_scales():
    from cmoe_jax.methods.cmoe import scale_router_up
    up = np.arange(12, dtype=np.float32).reshape(2, 6) + 1  # E = 3 experts of r = 2
    scaled, c = scale_router_up(up, [2.0, 0.0, -1.0], [1.0, 0.0, 1.0], 3)
    np.testing.assert_array_equal(c, [2.0, 1.0, 1.0])
    np.testing.assert_array_equal(scaled, up * np.repeat(c, 2)[None].astype(np.float32))
    assert scaled.dtype == up.dtype


def _python(code: str, devices: int = 1):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(devices))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_import_is_light_and_the_gmm_subpackage_imports_by_name():
    out = _python("""
        import sys
        import cmoe_jax.moe.gmm.pallas_gpu as kernels
        import cmoe_jax.moe as moe
        assert moe.gmm.pallas_gpu is kernels and callable(moe.grouped_matmul)
        heavy = ("orbax", "gguf", "safetensors", "transformers", "datasets", "torch")
        print(sorted(m for m in sys.modules if m.split(".")[0] in heavy))
    """)
    assert out.strip() == "[]", out


def test_checks_hold_expert_parallel_and_an_unset_mesh_warns():
    out = _python("""
        import warnings
        import numpy as np, jax, jax.numpy as jnp
        from flax import nnx
        from jax.sharding import NamedSharding, PartitionSpec as P
        from cmoe_jax.moe import MoEFFN, ExpertParallelWarning
        from jax.sharding import Mesh
        mesh = Mesh(np.array(jax.devices()), ("expert",))
        layer = MoEFFN(d_model=16, expert_width=8, num_experts=4, top_k=2, shared_width=8, activation="silu", rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.PRNGKey(0), (8, 16))
        want = layer(x)
        xs = jax.device_put(x, NamedSharding(mesh, P("expert")))
        with jax.set_mesh(mesh):
            try:
                layer(jnp.ones((8, 12)))
                raise SystemExit("a wrong width ran expert-parallel")
            except ValueError as e:
                assert "d_model=16" in str(e) and "12" in str(e), e
            assert layer(jnp.ones((0, 16))).shape == (0, 16)
            got = nnx.jit(lambda m, x: m(x))(layer, xs)
            hlo = nnx.jit(lambda m, x: m(x)).lower(layer, xs).as_text()
        assert "all_to_all" in hlo or "all-to-all" in hlo
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with mesh:
                layer(x)
        assert any(issubclass(i.category, ExpertParallelWarning) for i in w), [str(i.message) for i in w]
        sharded = NamedSharding(mesh, P("expert"))
        layer.expert_gate.set_value(jax.device_put(layer.expert_gate.get_value(), sharded))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            layer(x)
        assert any(issubclass(i.category, ExpertParallelWarning) for i in w)
        quiet = MoEFFN(d_model=16, expert_width=8, num_experts=4, top_k=2, expert_axis=None, activation="silu", rngs=nnx.Rngs(0))
        with warnings.catch_warnings():
            warnings.simplefilter("error", ExpertParallelWarning)
            with mesh:
                quiet(x)
        print("ok")
    """, devices=2)
    assert out.strip().endswith("ok")


def test_a_bf16_cmoe_router_scores_as_its_float64_recomputation():
    """bf16 input and router weights multiply without an upcast copy (float32 accumulation):
    the scores equal a float64 numpy recomputation on the same bf16 values."""
    from cmoe_jax.moe.routers.cmoe import cmoe_scores
    k = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(k[0], (64, 96)).astype(jnp.bfloat16)
    gate, up = ((jax.random.normal(kk, (96, 7 * 4)) * 0.1).astype(jnp.bfloat16) for kk in k[1:])
    got = cmoe_scores(x, gate, up, 7, activation="silu")
    xs, g, u = (np.asarray(a, np.float64) for a in (x, gate, up))
    pre = xs @ g
    want = np.abs(pre / (1 + np.exp(-pre)) * (xs @ u)).reshape(64, 7, 4).sum(-1)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)

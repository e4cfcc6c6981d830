"""Every dispatch path of `MoEFFN` computes the same layer: values and gradients against the
sort path on `jax.lax.ragged_dot` (the independent reference), the trace-time choice follows
its rule, and the dense path lowers for CUDA and TPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from cmoe_jax.moe import MoEFFN
from cmoe_jax.moe.dispatch import (Slabs, counting_plan, dense_experts, gathered_experts, pair_products,
                                   plan, slab_steps, sorting_plan)
from cmoe_jax.moe.modes import DENSE_WHEN, DenseWhen, PairCall, dense_when, dispatch_mode, pads_every_token

PATHS = ("sort", "gather", "dense", "padded", "auto")


def layer(path, backend="auto", router="cmoe", **kw):
    kw = dict(dict(d_model=32, expert_width=16, num_experts=6, top_k=2, shared_width=16), **kw)
    return MoEFFN(**kw, router=router, router_neurons=4 if router == "cmoe" else 1,
                  backend=backend, dispatch=path, expert_axis=None, activation="silu", rngs=nnx.Rngs(3))


def loss(model, x):
    return jnp.sum(jnp.sin(model(x)))


@pytest.mark.parametrize("router", ["cmoe", "linear"])
@pytest.mark.parametrize("tokens", [1, 3, 40, 300])
@pytest.mark.parametrize("path", PATHS)
def test_paths_equal_ragged_dot_values_and_gradients(path, tokens, router):
    x = jax.random.normal(jax.random.key(tokens), (tokens, 32))
    ref, got = layer("sort", "ragged_dot", router), layer(path, router=router)
    if router == "linear":  # a trained router's gates are not all 1
        assert float(jnp.std(ref.route(x)[1])) > 0
    np.testing.assert_allclose(got(x), ref(x), rtol=1e-5, atol=1e-6)
    g_ref, g_got = nnx.grad(loss)(ref, x), nnx.grad(loss)(got, x)
    for name in ("expert_gate", "expert_up", "expert_down", "shared_up"):
        np.testing.assert_allclose(getattr(g_got, name)[...], getattr(g_ref, name)[...],
                                   rtol=1e-4, atol=1e-6, err_msg=name)
    dx = lambda m: jax.grad(lambda x: loss(m, x))(x)  # noqa: E731
    np.testing.assert_allclose(dx(got), dx(ref), rtol=1e-4, atol=1e-6)


def test_dense_path_sums_repeated_experts_like_the_sort():
    """Two slots of a token on one expert (prototype slots after ConMoE) add up."""
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (5, 8))
    w = [jax.random.normal(kk, s) for kk, s in zip(k[1:], [(3, 8, 4), (3, 8, 4), (3, 4, 8)])]
    ids = jnp.array([[0, 0], [1, 2], [2, 2], [0, 1], [1, 1]], jnp.int32)
    gates = jnp.linspace(0.5, 1.5, 10).reshape(5, 2)
    y, counts = dense_experts(x, ids, gates, *w, "silu")
    h = lambda e, v: (jax.nn.silu(v @ w[0][e]) * (v @ w[1][e])) @ w[2][e]  # noqa: E731
    want = jnp.stack([sum(gates[t, s] * h(ids[t, s], x[t]) for s in range(2)) for t in range(5)])
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    assert counts.tolist() == [3, 4, 3]


def test_auto_follows_the_platform_rule(monkeypatch):
    monkeypatch.setitem(DENSE_WHEN, jax.default_backend(),
                        DenseWhen(rows_per_expert=4, share=0.5, share_tokens=100, gather_share=0.5))
    mode = lambda tokens, k, e, **kw: dispatch_mode(PairCall(tokens * k, e, k), **kw)  # noqa: E731
    assert mode(1, 2, 6) == "gather"                     # pairs <= experts x gather_share
    assert mode(2, 2, 6) == "dense"                      # above it: weights read once
    assert mode(12, 2, 6) == "dense"                     # 4 rows per expert
    assert mode(13, 2, 6) == "sort"                      # more rows, share 1/3
    assert mode(100, 3, 6) == "dense" and mode(101, 3, 6) == "sort"  # share 1/2, tokens bound
    assert mode(12, 2, 6, adapters=True) == "sort"       # LoRA rides on the grouped matmuls
    assert mode(500, 2, 6, dispatch="dense") == "dense"  # forced
    assert mode(2, 2, 6, dispatch="sort") == "sort"


def test_a_dtype_rule_overrides_the_platform_rule(monkeypatch):
    backend = jax.default_backend()
    monkeypatch.setitem(DENSE_WHEN, backend, DenseWhen(rows_per_expert=4, gather_share=0.5))
    monkeypatch.setitem(DENSE_WHEN, f"{backend}:bfloat16", DenseWhen(rows_per_expert=64, gather_share=0.5))
    mode = lambda dtype: dispatch_mode(PairCall(13 * 2, 6, 2, dtype))  # noqa: E731
    assert mode(jnp.bfloat16) == "dense"                 # 4.3 rows per expert <= 64
    assert mode(jnp.float32) == "sort" and mode(None) == "sort"  # no float32 key: the platform's


def test_padded_runs_where_its_rows_are_clearly_fewer_than_the_dense_paths(monkeypatch):
    monkeypatch.setitem(DENSE_WHEN, jax.default_backend(),
                        DenseWhen(rows_per_expert=4, share=0.5, share_tokens=1 << 30,
                                  gather_share=0.5, padded_share=0.7))
    def mode(tokens, k, e, call_size=0, **kw):
        return dispatch_mode(PairCall(tokens * k, e, k, expert_size=call_size), **kw)
    assert mode(3, 1, 8) == "gather"                     # pairs <= experts x gather_share
    assert mode(100, 1, 8) == "padded"                   # capacity 16 of 100 tokens
    assert mode(16, 3, 5) == "dense"                     # capacity 12 of 16 tokens: too few rows saved
    assert mode(100, 1, 8, adapters=True) == "sort"      # LoRA rides on the grouped matmuls
    monkeypatch.setitem(DENSE_WHEN, jax.default_backend(),
                        DenseWhen(rows_per_expert=4, gather_share=0.5, padded_share=0.7, padded_experts=8))
    assert mode(100, 1, 8) == "padded"                   # 8 routed experts: enough
    assert mode(100, 1, 7) == "sort"                     # fewer than padded_experts
    monkeypatch.setitem(DENSE_WHEN, jax.default_backend(),
                        DenseWhen(rows_per_expert=4, gather_share=0.5, padded_share=0.7, padded_experts=8,
                                  padded_tokens=100, large_expert_size=1000))
    assert mode(100, 1, 7) == "padded"                   # fewer, but a call of few tokens
    assert mode(101, 1, 7) == "sort"                     # more than padded_tokens
    assert mode(20, 1, 7) == "padded"                    # few tokens pad at any count
    assert mode(16, 3, 5) == "sort"                      # unless the padding saves no rows
    assert mode(101, 1, 7, call_size=1001) == "padded"   # large experts pad at any count
    monkeypatch.setitem(DENSE_WHEN, jax.default_backend(), DenseWhen(rows_per_expert=4))
    assert mode(100, 1, 8) == "sort"                     # padded_share 0: never padded


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU rule")
def test_the_cpu_rule_pads_16_expert_layers_and_sorts_8_expert_ones():
    """fp32 on CPU: a 16-expert adaptive layer (10 routed, 6 active) prefills padded, S3A3E8's
    5 routed experts keep the sort."""
    mode = lambda tokens, k, e: dispatch_mode(PairCall(tokens * k, e, k, jnp.float32))  # noqa: E731
    assert mode(8192, 6, 10) == "padded"
    assert mode(8192, 3, 5) == "sort"


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU rule")
def test_the_cpu_rule_pads_few_experts_at_up_to_256_tokens_and_over_large_experts():
    """fp32 on CPU, fewer than 8 routed experts: 128 tokens pad, and so does a decoding
    step of 16 rows over S1A1E8's 7 routed experts (capacity 4 of 16 tokens, then 6, then
    all 16 in place of the sort); S3A3E8's 16 tokens (capacity 12) stay dense; 16 tokens over Llama-2-7B's experts (4096 x 1376) pad.
    One token gathers where it uses at most three quarters of the routed experts."""
    mode = lambda tokens, k, e, m=192: dispatch_mode(PairCall(tokens * k, e, k, jnp.float32, 576 * m))  # noqa: E731
    assert mode(128, 3, 5) == "padded" and mode(128, 1, 7) == "padded"
    assert mode(16, 1, 7) == "padded" and mode(16, 3, 5) == "dense"
    call = lambda tokens, k, e: PairCall(tokens * k, e, k, jnp.float32, 576 * 192)  # noqa: E731
    assert pads_every_token(call(16, 1, 7)) and pads_every_token(call(16, 2, 6))  # no sort fallback
    assert not pads_every_token(call(128, 1, 7))         # 128 pairs over 7: the sort beats all tokens
    assert mode(257, 1, 7) == "sort"
    assert mode(1, 3, 5) == "gather" and mode(1, 4, 5) == "dense"  # one token: 3 of 5 gather
    for m in (192, 1376 * 4096 // 576):  # in bf16 too, over small experts and large ones
        assert dispatch_mode(PairCall(3, 5, 3, jnp.bfloat16, 576 * m)) == "gather"
    assert mode(16, 1, 7, m=4096 * 1376 // 576) == "padded"


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU rule")
def test_the_cpu_rule_gathers_one_token_in_slabs_over_llama_7b_experts_in_fp32():
    """One token over Llama-2-7B's experts (4096 x 11008 / 8 or / 16) gathers, in fp32 a
    slab of at most 256 KiB an expert at a time (16 steps of 1.4 MiB at most), where
    SmolLM2's and Gemma 3 270M's experts (at most 1 MiB) stay whole; bf16 and SmolLM2's
    experts gather too."""
    mode = lambda k, e, m, dtype=jnp.float32: dispatch_mode(PairCall(k, e, k, dtype, 4096 * m))  # noqa: E731
    assert mode(1, 7, 1376) == mode(3, 15, 688) == mode(2, 6, 1376) == mode(3, 5, 1376) == "gather"
    assert mode(1, 7, 1376, jnp.bfloat16) == "gather"
    assert dispatch_mode(PairCall(1, 7, 1, jnp.float32, 576 * 192)) == "gather"
    slabs = dense_when(jnp.float32).slabs()
    assert slab_steps(4096, 4096 * 1376 * 4, slabs) == 16
    assert slab_steps(576, 576 * 192 * 4, slabs) == slab_steps(640, 640 * 256 * 4, slabs) == 1  # in cache whole
    assert dense_when(jnp.bfloat16).slabs() is None


@pytest.mark.parametrize("depth", [12, 7])
@pytest.mark.parametrize("slabs", [None, Slabs(100, 16), Slabs(1, 16)])
def test_pair_products_in_slabs_equal_each_pairs_own_product(depth, slabs):
    """Slabs of the contraction (a divisor of it; a prime one row each) sum to each pair's
    product with its own expert, values and gradients."""
    rng = np.random.default_rng(depth)
    a = jnp.asarray(rng.normal(size=(5, depth)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, depth, 3)), jnp.float32)
    experts = jnp.asarray([3, 0, 3, 1, 2], jnp.int32)
    want = lambda a, w: jnp.stack([a[p] @ w[int(e)] for p, e in enumerate(experts)])  # noqa: E731
    got = lambda a, w: pair_products(a, w, experts, slabs)  # noqa: E731
    np.testing.assert_allclose(got(a, w), want(a, w), rtol=1e-5, atol=1e-6)
    f = lambda fn: jax.grad(lambda a, w: jnp.sum(jnp.sin(fn(a, w))), argnums=(0, 1))(a, w)  # noqa: E731
    for g, r in zip(f(got), f(want)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_slab_steps_divide_the_contraction_within_the_budget():
    four_mib = 4096 * 256 * 4
    assert slab_steps(4096, four_mib, Slabs(four_mib, 16)) == 1
    assert slab_steps(4096, four_mib, Slabs(1 << 20, 16)) == 4
    assert slab_steps(576, 576 * 192 * 4, Slabs(1 << 18, 16)) == 2      # 442 KiB: two slabs
    assert slab_steps(1376, 1376 * 4096 * 4, Slabs(1 << 20, 16)) == 16  # 22 wanted, 16 at most
    assert slab_steps(4096, 22 << 20, Slabs(1 << 20, 16)) == 16
    assert slab_steps(7, 100, Slabs(1, 16)) == 7 and slab_steps(7, 100, Slabs(1, 4)) == 1  # a prime
    assert slab_steps(576, 576 * 192 * 4, Slabs(1 << 18, 16, min_bytes=1 << 20)) == 1  # small: whole
    assert slab_steps(576, (1 << 20) + 1, Slabs(1 << 18, 16, min_bytes=1 << 20)) == 6   # just above it


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_gather_in_slabs_lowers_for_accelerators(platform):
    def f(x, ids, gates, wg, wu, wd):
        return jnp.sum(gathered_experts(x, ids, gates, wg, wu, wd, "silu", Slabs(1 << 18, 16))[0] ** 2)

    s = jax.ShapeDtypeStruct
    args = (s((1, 4096), jnp.float32), s((1, 3), jnp.int32), s((1, 3), jnp.float32),
            s((5, 4096, 1376), jnp.float32), s((5, 4096, 1376), jnp.float32), s((5, 1376, 4096), jnp.float32))
    exp = jax.export.export(jax.jit(jax.value_and_grad(f, argnums=(0, 3, 4, 5))), platforms=[platform])(*args)
    assert "dot_general" in exp.mlir_module()


def test_unknown_dispatch_is_refused():
    with pytest.raises(ValueError, match="dispatch must be one of"):
        layer("fast")


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_dense_path_lowers_for_accelerators(platform):
    """Value and gradients of the dense path at Llama-2-7B S3A3E8 expert shapes."""
    def f(x, ids, gates, wg, wu, wd):
        return jnp.sum(dense_experts(x, ids, gates, wg, wu, wd, "silu")[0] ** 2)

    s = jax.ShapeDtypeStruct
    args = (s((16, 4096), jnp.bfloat16), s((16, 3), jnp.int32), s((16, 3), jnp.float32),
            s((5, 4096, 1376), jnp.bfloat16), s((5, 4096, 1376), jnp.bfloat16),
            s((5, 1376, 4096), jnp.bfloat16))
    exp = jax.export.export(jax.jit(jax.value_and_grad(f, argnums=(0, 3, 4, 5))),
                            platforms=[platform])(*args)
    assert "dot_general" in exp.mlir_module()


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.integers(1, 12), st.integers(1, 300), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_counting_plan_is_the_stable_argsort(num_experts, tokens, top_k, seed):
    """The counting sort, the argsort and the plan that picks one give numpy's stable sort of the expert ids (a dropped
    pair, id E, after every group), its inverse, and the per-expert counts."""
    ids = np.random.default_rng(seed).integers(0, num_experts + 1, (tokens, top_k)).astype(np.int32)
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    for d in (counting_plan(jnp.asarray(flat), num_experts), sorting_plan(jnp.asarray(flat), num_experts),
              plan(jnp.asarray(ids), num_experts)):
        np.testing.assert_array_equal(d.order, order)
        np.testing.assert_array_equal(np.asarray(d.order)[d.inverse], np.arange(flat.size))
        np.testing.assert_array_equal(d.group_sizes, np.bincount(flat, minlength=num_experts + 1)[:num_experts])


@pytest.mark.parametrize("tokens", [1, 3, 40, 300])
def test_auto_compiles_to_the_program_of_the_path_it_names(tokens):
    """The choice is made at trace time: `auto` costs nothing at run time, so a benchmark may
    time the named path as a forced one and call it the rule's."""
    import re

    x = jnp.ones((tokens, 32), jnp.float32)
    named = dispatch_mode(PairCall(tokens * 2, 6, 2, jnp.float32, 32 * 16))

    def compiled(path):
        graphdef, state = nnx.split(layer(path))
        run = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
        text = run.lower(state, x).compile().as_text()
        text = re.sub(r"(?m)^(FileNames|FunctionNames|FileLocations|StackFrames|\d+ [{\"].*)\n", "", text)
        return re.sub(r"metadata=\{[^}]*\}", "", text)  # the source table and positions

    programs = {path: compiled(path) for path in ("sort", "gather", "dense", "padded")}
    auto = compiled("auto")
    assert [p for p, text in programs.items() if text == auto] == [named]

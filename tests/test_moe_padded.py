"""The padded dispatch on every rung of its capacity ladder and on its sort fallback: values
against a direct per-token recomputation, gradients against the sort path on
`jax.lax.ragged_dot`, and lowering for CUDA and TPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cmoe_jax.moe.dispatch import GLUExperts, routed_experts
from cmoe_jax.moe.gmm import get_gmm, get_glu
from cmoe_jax.moe.padded import capacity_ladder, padded_experts

E, D, M, T = 4, 16, 8, 160
LOADS = (40, 50, 60, 70, 100)  # expert 0's tokens: each rung of the ladder (48, 56, 64, 80), then sort


def weights(seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(kk, s) * 0.3 for kk, s in zip(k, [(E, D, M), (E, D, M), (E, M, D)])]


def experts(w, backend="auto"):
    return GLUExperts(*w, get_gmm(backend), "silu", glu=get_glu(backend))


def brute_force(x, ids, gates, w):
    """Every expert on every token, then each token's chosen ones summed with their gates."""
    h = jnp.stack([(jax.nn.silu(x @ w[0][e]) * (x @ w[1][e])) @ w[2][e] for e in range(E)])
    picked = h[jnp.minimum(ids, E - 1), jnp.arange(x.shape[0])[:, None]]      # [T, k, D]
    return jnp.einsum("tkd,tk->td", picked, jnp.where(ids < E, gates, 0.0))


def routing(load_of_expert0):
    """ids [T, 1]: expert 0 for the first `load_of_expert0` tokens, the others in turn."""
    rest = 1 + np.arange(T - load_of_expert0) % (E - 1)
    return np.concatenate([np.zeros(load_of_expert0), rest]).astype(np.int32)[:, None]


def rung(ids):
    caps = capacity_ladder(ids.size, E)
    return int(np.sum(np.asarray(caps) < np.bincount(ids[ids < E].ravel(), minlength=E).max()))


def test_ladder_runs_from_a_balanced_group_to_twice_it():
    assert capacity_ladder(4096, 7) == (664, 736, 880, 1176)  # mean 585.1: x1.125 ... x2
    assert capacity_ladder(3, 1) == (3,)                  # capped at the pair count
    assert capacity_ladder(128, 7) == (22, 24, 28, 40)    # small groups: pairs of rows
    assert capacity_ladder(48, 4) == (14, 16, 18, 24)


def test_ladder_that_covers_the_tokens_ends_at_them():
    """16 tokens of one slot over 7 experts (a decoding step of 16 rows): rungs of 4 and 6
    rows, then all 16; 16 tokens of three slots over 5 experts: no rung above the tokens."""
    assert capacity_ladder(16, 7) == (4, 6)
    assert capacity_ladder(16, 7, tokens=16) == (4, 6, 16)
    assert capacity_ladder(48, 5, tokens=16) == (12, 16)


@pytest.mark.parametrize("load", LOADS)
def test_every_rung_and_the_fallback_give_the_recomputation(load):
    ids = routing(load)
    assert capacity_ladder(T, E) == (48, 56, 64, 80)
    assert rung(ids) == LOADS.index(load)  # each case its own branch
    w = weights()
    x = jax.random.normal(jax.random.key(1), (T, D))
    gates = jax.random.uniform(jax.random.key(2), (T, 1), minval=0.2)
    y, sizes = jax.jit(lambda x: padded_experts(x, jnp.asarray(ids), gates, experts(w)))(x)
    np.testing.assert_allclose(y, brute_force(x, ids, gates, w), rtol=1e-5, atol=1e-5)
    assert sizes.tolist() == np.bincount(ids.ravel(), minlength=E).tolist()


@pytest.mark.parametrize("load", LOADS[::2] + LOADS[-1:])
def test_gradients_equal_the_ragged_dot_sort_path(load):
    ids = jnp.asarray(routing(load))
    gates = jax.random.uniform(jax.random.key(2), (T, 1), minval=0.2)
    x = jax.random.normal(jax.random.key(1), (T, D))

    def loss(run, backend):
        return lambda x, *w: jnp.sum(jnp.sin(run(x, ids, gates, experts(list(w), backend))[0]))

    args = (x, *weights())
    got = jax.grad(loss(padded_experts, "auto"), argnums=(0, 1, 2, 3))(*args)
    want = jax.grad(loss(routed_experts, "ragged_dot"), argnums=(0, 1, 2, 3))(*args)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("load", [3, 7, 16])
def test_covering_the_tokens_pads_every_routing_of_distinct_experts(load):
    """With `cover_tokens`, 16 tokens over 4 experts, expert 0 taking `load` of them: the
    ladder (6, 8, 16) holds every load up to all 16 tokens, no sort (each case its own rung);
    the values equal the
    recomputation and the gradients the sort path on `ragged_dot`."""
    tokens = 16
    ids = np.concatenate([np.zeros(load), 1 + np.arange(tokens - load) % (E - 1)]).astype(np.int32)[:, None]
    caps = capacity_ladder(tokens, E, tokens=tokens)
    assert caps == (6, 8, 16)
    assert np.sum(np.asarray(caps) < np.bincount(ids.ravel()).max()) == [3, 7, 16].index(load)
    w = weights(4)
    x = jax.random.normal(jax.random.key(5), (tokens, D))
    gates = jax.random.uniform(jax.random.key(6), (tokens, 1), minval=0.2)
    run = lambda x, *w: padded_experts(x, jnp.asarray(ids), gates, experts(list(w)), cover_tokens=True)[0]  # noqa: E731
    np.testing.assert_allclose(jax.jit(run)(x, *w), brute_force(x, ids, gates, w), rtol=1e-5, atol=1e-5)
    sort = lambda x, *w: routed_experts(x, jnp.asarray(ids), gates, experts(list(w), "ragged_dot"))[0]  # noqa: E731
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    got = jax.grad(loss(run), argnums=(0, 1, 2, 3))(x, *w)
    want = jax.grad(loss(sort), argnums=(0, 1, 2, 3))(x, *w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_dropped_and_repeated_pairs():
    """A dropped pair (id E, gate 0) adds nothing; two slots on one expert add up."""
    ids = np.concatenate([routing(40), (routing(70) + 1) % E], axis=1)
    ids[::5, 1] = E
    ids[1::5, 1] = ids[1::5, 0]
    gates = jnp.where(jnp.asarray(ids) < E, 0.7, 0.0)
    x = jax.random.normal(jax.random.key(1), (T, D))
    w = weights(3)
    y, _ = padded_experts(x, jnp.asarray(ids), gates, experts(w))
    np.testing.assert_allclose(y, brute_force(x, ids, gates, w), rtol=1e-5, atol=1e-5)


def test_a_dropped_pair_adds_exactly_zero_whatever_its_row_holds():
    """Token 0 is padding (both its pairs dropped) and holds NaN, which the padded rows copy;
    the dropped pairs of the other tokens point at such rows, and still add nothing: every
    other token equals the recomputation without token 0, token 0's output is 0."""
    ids = np.concatenate([routing(40), (routing(70) + 1) % E], axis=1)
    ids[0] = E
    ids[3::5, 1] = E
    gates = jnp.where(jnp.asarray(ids) < E, 0.7, 0.0)
    x = jax.random.normal(jax.random.key(1), (T, D)).at[0].set(jnp.nan)
    w = weights(3)
    y, _ = padded_experts(x, jnp.asarray(ids), gates, experts(w))
    assert np.all(np.asarray(y[0]) == 0)
    np.testing.assert_allclose(y[1:], brute_force(x[1:], ids[1:], gates[1:], w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_padded_path_lowers_for_accelerators(platform):
    """Value and gradients at Llama-2-7B S3A3E8 expert shapes, 256 tokens, bf16 (the sort
    fallback on `ragged_dot`; the grouped-matmul kernels' lowering: test_gmm_lowering)."""
    def f(x, ids, gates, wg, wu, wd):
        ex = GLUExperts(wg, wu, wd, get_gmm("ragged_dot"), "silu")
        return jnp.sum(padded_experts(x, ids, gates, ex)[0] ** 2)

    s = jax.ShapeDtypeStruct
    args = (s((256, 4096), jnp.bfloat16), s((256, 3), jnp.int32), s((256, 3), jnp.float32),
            s((5, 4096, 1376), jnp.bfloat16), s((5, 4096, 1376), jnp.bfloat16),
            s((5, 1376, 4096), jnp.bfloat16))
    exp = jax.export.export(jax.jit(jax.value_and_grad(f, argnums=(0, 3, 4, 5))),
                            platforms=[platform])(*args)
    text = exp.mlir_module()
    assert "dot_general" in text and "case" in text

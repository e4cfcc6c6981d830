"""AbsTopk-GLU, magnitude and Wanda pruning against direct per-token / per-entry recomputation."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import sys
from pathlib import Path

from flax import nnx

from cmoe_jax.models.layers import SwiGLU

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sparsity_baselines_lib import (AbsTopkGLU, abstopk_glu, magnitude_prune,  # noqa: E402
                                               prune_ffn, wanda_prune)

RNG = np.random.default_rng(0)
X, WG, WU, WD = RNG.normal(size=(7, 8)), RNG.normal(size=(8, 12)), RNG.normal(size=(8, 12)), RNG.normal(size=(12, 8))


def _silu(a):
    return a / (1 + np.exp(-a))


def test_abstopk_glu_keeps_the_k_largest_gate_magnitudes_per_token():
    want = []
    for x in X:
        g = _silu(x @ WG)
        keep = np.argsort(-np.abs(g))[:5]
        mask = np.zeros(12)
        mask[keep] = 1
        want.append((g * mask * (x @ WU)) @ WD)
    got = abstopk_glu(jnp.asarray(X, jnp.float32), WG.astype(np.float32), WU.astype(np.float32),
                      WD.astype(np.float32), 5)
    np.testing.assert_allclose(np.asarray(got), np.array(want), rtol=1e-4, atol=1e-4)
    dense = ((_silu(X @ WG)) * (X @ WU)) @ WD  # keeping all neurons is the dense FFN
    np.testing.assert_allclose(np.asarray(abstopk_glu(X, WG, WU, WD, 12)), dense, rtol=1e-6)


def test_abstopk_layer_is_a_drop_in_swiglu():
    mlp = SwiGLU(8, 12, dtype=jnp.float32, activation="silu", rngs=nnx.Rngs(0))
    sparse = AbsTopkGLU(mlp, 5)
    want = abstopk_glu(X, mlp.gate[...], mlp.up[...], mlp.down[...], 5)
    np.testing.assert_allclose(np.asarray(sparse(jnp.asarray(X, jnp.float32))), np.asarray(want), rtol=1e-5)


def test_magnitude_zeroes_the_smallest_entries_of_the_matrix():
    w = RNG.normal(size=(10, 6))
    got = magnitude_prune(w, 0.25)
    n = round(0.25 * w.size)
    assert (got == 0).sum() == n
    cut = np.sort(np.abs(w).ravel())[n]  # the smallest kept magnitude
    np.testing.assert_array_equal(got, np.where(np.abs(w) >= cut, w, 0))


def test_wanda_prunes_lowest_weight_times_input_norm_per_output():
    w, x = RNG.normal(size=(10, 6)), RNG.normal(size=(30, 10))
    norm = np.sqrt((x ** 2).sum(0))
    got = wanda_prune(w, norm, 0.5)
    for o in range(6):  # each output neuron (column) keeps its 5 highest |w| ||x|| inputs
        score = np.abs(w[:, o]) * norm
        keep = np.argsort(-score)[:5]
        want = np.zeros(10)
        want[keep] = w[keep, o]
        np.testing.assert_array_equal(got[:, o], want)


def test_prune_ffn_wanda_uses_each_matrix_input():
    mlp = SwiGLU(8, 12, dtype=jnp.float32, activation="silu", rngs=nnx.Rngs(0))
    wg, wu, wd = (np.asarray(p[...]) for p in (mlp.gate, mlp.up, mlp.down))
    x = RNG.normal(size=(2, 5, 8)).astype(np.float32)
    prune_ffn(mlp, 0.5, "wanda", jnp.asarray(x))
    flat = x.reshape(-1, 8).astype(np.float64)
    h = _silu(flat @ wg) * (flat @ wu)
    xn, hn = np.sqrt((flat ** 2).sum(0)), np.sqrt((h ** 2).sum(0))
    np.testing.assert_allclose(np.asarray(mlp.gate[...]), wanda_prune(wg, xn, 0.5), atol=1e-7)
    np.testing.assert_allclose(np.asarray(mlp.up[...]), wanda_prune(wu, xn, 0.5), atol=1e-7)
    np.testing.assert_allclose(np.asarray(mlp.down[...]), wanda_prune(wd, hn, 0.5), atol=1e-7)

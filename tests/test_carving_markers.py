"""ATopK markers, activation rates and the profiling hidden state, vs numpy."""
from __future__ import annotations

import numpy as np
import pytest

from cmoe_jax.carving import (activation_rates, atopk_markers, ffn_hidden, marker_counts,
                              profile_markers)
from cmoe_jax.carving.markers import profile_layer


def _np_hidden(x, wg, wu, normalize):
    x, wg, wu = (np.asarray(a, np.float64) for a in (x, wg, wu))
    if normalize:
        x = x / np.linalg.norm(x, axis=1, keepdims=True)
        wg = wg / np.linalg.norm(wg, axis=0, keepdims=True)
        wu = wu / np.linalg.norm(wu, axis=0, keepdims=True)
    a = x @ wg
    return a / (1 + np.exp(-a)) * (x @ wu)


def _np_markers(h, k):
    out = np.zeros(h.shape, bool)
    np.put_along_axis(out, np.argsort(-np.abs(h), axis=1, kind="stable")[:, :k], True, axis=1)
    return out


def _inputs(seed=0, tokens=64, d=12, d_h=40):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(tokens, d)).astype(np.float32), rng.normal(size=(d, d_h)).astype(np.float32),
            rng.normal(size=(d, d_h)).astype(np.float32))


@pytest.mark.parametrize("normalize", [False, True])
def test_hidden_and_markers_match_numpy(normalize):
    x, wg, wu = _inputs()
    h = _np_hidden(x, wg, wu, normalize)
    np.testing.assert_allclose(np.asarray(ffn_hidden(x, wg, wu, normalize)), h, rtol=2e-5, atol=2e-6)
    markers, mu = profile_markers(x, wg, wu, k_act=5, normalize=normalize)
    expected = _np_markers(h, 5)
    np.testing.assert_array_equal(np.asarray(markers), expected)
    assert np.asarray(markers).dtype == np.bool_ and (np.asarray(markers).sum(axis=1) == 5).all()
    np.testing.assert_allclose(np.asarray(mu), expected.mean(axis=0), atol=1e-7)
    np.testing.assert_allclose(activation_rates(markers), expected.mean(axis=0), atol=0)


def test_normalisation_removes_token_and_column_scales():
    x, wg, wu = _inputs(1)
    scale_t = np.linspace(0.1, 10, len(x), dtype=np.float32)[:, None]
    scale_c = np.linspace(0.5, 4, wg.shape[1], dtype=np.float32)[None, :]
    base = np.asarray(ffn_hidden(x, wg, wu))
    scaled = np.asarray(ffn_hidden(x * scale_t, wg * scale_c, wu / scale_c))
    np.testing.assert_allclose(scaled, base, rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(ffn_hidden(x * scale_t, wg, wu, normalize=False)),
                           np.asarray(ffn_hidden(x, wg, wu, normalize=False)))


def test_atopk_markers_on_given_hidden():
    rng = np.random.default_rng(3)
    h = rng.normal(size=(30, 25))
    np.testing.assert_array_equal(np.asarray(atopk_markers(h, 4)), _np_markers(h, 4))
    np.testing.assert_array_equal(np.asarray(atopk_markers(h, 25)), np.ones_like(h, bool))


def test_chunk_counts_sum_to_total():
    x, wg, wu = _inputs(2, tokens=96)
    total = np.asarray(marker_counts(x, wg, wu, k_act=6))
    chunks = sum(np.asarray(marker_counts(x[i:i + 32], wg, wu, k_act=6)) for i in range(0, 96, 32))
    assert total.dtype == np.int32
    np.testing.assert_array_equal(total, chunks)
    np.testing.assert_array_equal(total, _np_markers(_np_hidden(x, wg, wu, True), 6).sum(axis=0))
    assert total.sum() == 96 * 6


@pytest.mark.parametrize("normalize", [False, True])
def test_profile_layer_markers_and_energy_match_numpy(normalize):
    x, wg, wu = _inputs(4)
    wd = np.random.default_rng(5).normal(size=(wg.shape[1], x.shape[1])).astype(np.float32)
    markers, mu, energy = profile_layer(x, wg, wu, wd, k_act=5, normalize=normalize)
    expected = _np_markers(_np_hidden(x, wg, wu, normalize), 5)
    np.testing.assert_array_equal(np.asarray(markers), expected)
    np.testing.assert_allclose(np.asarray(mu), expected.mean(axis=0), atol=1e-7)
    plain = _np_hidden(x, wg, wu, False)
    np.testing.assert_allclose(np.asarray(energy), (plain ** 2).mean(axis=0) * (wd.astype(np.float64) ** 2).sum(axis=1),
                               rtol=1e-4)

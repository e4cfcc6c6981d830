"""`profile_layer`: ATopK markers, activation rates and output energies, vs numpy."""
from __future__ import annotations

import numpy as np
import pytest

from cmoe_jax.calibration_pass.markers import profile_layer


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


def _down(d_h, d, seed=5):
    return np.random.default_rng(seed).normal(size=(d_h, d)).astype(np.float32)


def test_normalisation_removes_token_and_column_scales():
    """Normalised markers ignore per-token and per-neuron scales; the plain ones do not."""
    x, wg, wu = _inputs(1)
    wd = _down(wg.shape[1], x.shape[1])
    scale_t = np.linspace(0.1, 10, len(x), dtype=np.float32)[:, None]
    scale_c = np.linspace(0.5, 4, wg.shape[1], dtype=np.float32)[None, :]
    base = np.asarray(profile_layer(x, wg, wu, wd, k_act=5, activation="silu")[0])
    scaled = np.asarray(profile_layer(x * scale_t, wg * scale_c, wu * scale_c, wd, k_act=5, activation="silu")[0])
    np.testing.assert_array_equal(scaled, base)
    np.testing.assert_array_equal(base, _np_markers(_np_hidden(x, wg, wu, True), 5))
    plain = lambda xs, g: np.asarray(profile_layer(xs, g, wu, wd, k_act=5, normalize=False, activation="silu")[0])
    assert not np.array_equal(plain(x, wg * scale_c), plain(x, wg))


def test_markers_of_chunks_add_up():
    """Marker counts of token chunks sum to the whole batch's (what a data-parallel sum needs)."""
    x, wg, wu = _inputs(2, tokens=96)
    wd = _down(wg.shape[1], x.shape[1])
    total = np.asarray(profile_layer(x, wg, wu, wd, k_act=6, activation="silu")[0]).sum(axis=0)
    chunks = sum(np.asarray(profile_layer(x[i:i + 32], wg, wu, wd, k_act=6, activation="silu")[0]).sum(axis=0)
                 for i in range(0, 96, 32))
    np.testing.assert_array_equal(total, chunks)
    np.testing.assert_array_equal(total, _np_markers(_np_hidden(x, wg, wu, True), 6).sum(axis=0))
    assert total.sum() == 96 * 6


@pytest.mark.parametrize("normalize", [False, True])
def test_profile_layer_markers_and_energy_match_numpy(normalize):
    x, wg, wu = _inputs(4)
    wd = np.random.default_rng(5).normal(size=(wg.shape[1], x.shape[1])).astype(np.float32)
    markers, mu, energy = profile_layer(x, wg, wu, wd, k_act=5, normalize=normalize, activation="silu")
    expected = _np_markers(_np_hidden(x, wg, wu, normalize), 5)
    np.testing.assert_array_equal(np.asarray(markers), expected)
    assert np.asarray(markers).dtype == np.bool_ and (np.asarray(markers).sum(axis=1) == 5).all()
    np.testing.assert_allclose(np.asarray(mu), expected.mean(axis=0), atol=1e-7)
    plain = _np_hidden(x, wg, wu, False)
    np.testing.assert_allclose(np.asarray(energy), (plain ** 2).mean(axis=0) * (wd.astype(np.float64) ** 2).sum(axis=1),
                               rtol=1e-4)

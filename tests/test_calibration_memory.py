"""What the calibration pass does to hold less memory changes no result: a wide dense FFN run a
window at a time equals the numpy FFN and the whole batch's run, the profile taken window by
window equals one over every window, and the down fit's in-place solve equals numpy's."""
from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
from flax import nnx

from cmoe_jax.calibration_pass import layer_pass
from cmoe_jax.calibration_pass.layer_pass import calibration_mesh, run_ffn, shard_batch
from cmoe_jax.calibration_pass.markers import profile_layer
from cmoe_jax.convert import ConvertConfig
from cmoe_jax.methods.cmoe import MoEPlan
from cmoe_jax.methods.cmoe.convert import layer_profile
from cmoe_jax.methods.cmoe.router import solve_down
from cmoe_jax.models.layers import SwiGLU
from tests.moe_numpy import silu

D, DH, WINDOWS, T = 16, 48, 3, 8


def _ffn_and_batch():
    ffn = SwiGLU(D, DH, dtype=jnp.float32, rngs=nnx.Rngs(0), activation="silu")
    rng = np.random.default_rng(0)
    h, x = (rng.normal(size=(WINDOWS, T, D)).astype(np.float32) for _ in range(2))
    return ffn, h, x


def test_a_wide_dense_ffn_runs_a_window_at_a_time_as_the_whole_batch(monkeypatch):
    ffn, h, x = _ffn_and_batch()
    mesh = calibration_mesh(WINDOWS)
    whole, _ = run_ffn(ffn, shard_batch(h, mesh), shard_batch(x, mesh), mesh)
    seen, step = [], layer_pass.ffn_residual_step

    def counted(*args):
        seen.append(args[2].shape)
        return step(*args)

    monkeypatch.setattr(layer_pass, "DENSE_CHUNK_BYTES", 0)
    monkeypatch.setattr(layer_pass, "ffn_residual_step", counted)
    chunked, load = run_ffn(ffn, shard_batch(h, mesh), shard_batch(x, mesh), mesh)
    assert seen == [(1, T, D)] * WINDOWS and load.shape == (0,)
    w = {n: np.asarray(getattr(ffn, n)[...], np.float64) for n in ("gate", "up", "down")}
    want = h + (silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"]
    np.testing.assert_allclose(np.asarray(chunked), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), rtol=1e-6, atol=1e-6)


def test_the_profile_taken_window_by_window_is_the_whole_batch_profile():
    ffn, _, x = _ffn_and_batch()
    cc = ConvertConfig(plan=MoEPlan.parse("S1A2E8"), k_act=5)
    markers, mu, energy = layer_profile(types.SimpleNamespace(mlp=ffn), jnp.asarray(x), cc)
    want_markers, _, sums = profile_layer(x.reshape(-1, D), ffn.gate[...], ffn.up[...], ffn.down[...],
                                          k_act=5, windows=WINDOWS, activation="silu")
    np.testing.assert_array_equal(markers, np.asarray(want_markers))
    np.testing.assert_array_equal(mu, np.asarray(want_markers).mean(0, dtype=np.float64).astype(np.float32))
    tokens = WINDOWS * T
    np.testing.assert_array_equal(energy, (np.asarray(sums, np.float64).sum(0) / tokens).astype(np.float32))


def test_the_in_place_solve_is_the_ridge_solution_and_leaves_its_input_unless_told():
    rng = np.random.default_rng(1)
    p = rng.normal(size=(40, 12)).astype(np.float32)
    ptp = (p.T @ p).astype(np.float64)
    pty, w0 = rng.normal(size=(12, 5)), rng.normal(size=(12, 5))
    lam = 0.1 * np.mean(np.diag(ptp))
    want = np.linalg.solve(ptp + lam * np.eye(12), pty + lam * w0)
    kept = ptp.copy()
    np.testing.assert_allclose(solve_down(ptp, pty, w0, 0.1), want, rtol=1e-10)
    np.testing.assert_array_equal(ptp, kept)
    np.testing.assert_allclose(solve_down(ptp, pty, w0, 0.1, overwrite=True), want, rtol=1e-10)

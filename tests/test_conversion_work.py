"""What a conversion leaves out to save time changes no result: each converted layer runs
forward over the calibration batch once (the stream its error was measured on is the one
the pass carries on), and the down fit's Gram matrix taken from its upper blocks is P^T P."""
from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cmoe_jax.calibration_pass import layer_pass
from cmoe_jax.convert import ConvertConfig, convert_model
from cmoe_jax.methods.cmoe import MoEPlan
from cmoe_jax.methods.cmoe.routed_gram import routed_normal_equations
from cmoe_jax.methods.cmoe.router import symmetric_gram
from cmoe_jax.models import Decoder, ModelConfig
from cmoe_jax.moe import MoELayer


def _count_runs(monkeypatch) -> list:
    """The FFN kinds `run_ffn` runs, in order."""
    seen, run = [], layer_pass.run_ffn

    def counted(ffn, *args, **kwargs):
        seen.append("moe" if isinstance(ffn, MoELayer) else "dense")
        return run(ffn, *args, **kwargs)

    monkeypatch.setattr(layer_pass, "run_ffn", counted)
    return seen


CFG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                  num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, activation="silu",
                  max_position_embeddings=64)


def _tiny():
    calib = np.random.default_rng(0).integers(0, CFG.vocab_size, size=(4, 32)).astype(np.int32)
    return Decoder(CFG, rngs=nnx.Rngs(0)), calib


def test_each_converted_layer_runs_forward_once_and_the_model_is_unchanged(monkeypatch):
    dense, calib = _tiny()
    cc = ConvertConfig(plan=MoEPlan.parse("S1A2E8"), k_act=4)
    # the pass as it was: the method's stream dropped, the converted layer run again
    with monkeypatch.context() as m:
        m.setattr(layer_pass.LayerInput, "run", layer_pass.LayerInput.stream_after)
        again, _ = convert_model(copy.deepcopy(dense), calib, cc, progress=False)
    seen = _count_runs(monkeypatch)
    once, records = convert_model(copy.deepcopy(dense), calib, cc, progress=False)
    # per layer the converted FFN, once; the error's dense reference is the down fit's target
    assert seen == ["moe"] * 3
    assert all(r.error is not None and r.error > 0 for r in records)
    a, b = (jax.tree_util.tree_flatten_with_path(nnx.state(m))[0] for m in (again, once))
    assert [path for path, _ in a] == [path for path, _ in b]
    for (_, x), (_, y) in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("sandwich", [False, True])
def test_the_stream_error_from_the_fits_target_is_the_dense_passes(monkeypatch, sandwich):
    """The dense stream a layer's error is measured against, made from the down fit's target
    on the CPU, equals the one a dense pass makes (the accelerators' way, and a fit on a
    subset of the tokens), a norm on the FFN's output (Gemma) included; the models agree."""
    from cmoe_jax.methods.cmoe import layer_fit

    cfg = dataclasses.replace(CFG, sandwich_norms=sandwich)
    dense, calib = Decoder(cfg, rngs=nnx.Rngs(0)), _tiny()[1]
    cc = ConvertConfig(plan=MoEPlan.parse("S1A2E8"), k_act=4)
    seen = _count_runs(monkeypatch)
    fitted, from_target = convert_model(copy.deepcopy(dense), calib, cc, progress=False)
    assert seen == ["moe"] * 3
    seen.clear()
    monkeypatch.setattr(layer_fit, "on_cpu", lambda mesh: False)
    refit, from_pass = convert_model(copy.deepcopy(dense), calib, cc, progress=False)
    assert seen == ["dense", "moe"] * 3
    np.testing.assert_allclose([r.error for r in from_target], [r.error for r in from_pass], rtol=1e-4)
    for x, y in zip(jax.tree.leaves(nnx.state(fitted)), jax.tree.leaves(nnx.state(refit))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)


def test_the_pass_runs_an_ffn_again_when_the_method_returns_another(monkeypatch):
    dense, calib = _tiny()
    mesh = layer_pass.calibration_mesh(calib.shape[0])
    h, rope = layer_pass.start_pass(dense, calib, mesh)

    def tried_then_kept(inputs):  # runs the dense FFN, then returns a copy of it
        inputs.run(inputs.layer.mlp, mesh)
        return copy.deepcopy(inputs.layer.mlp)

    seen = _count_runs(monkeypatch)
    out = layer_pass.layer_pass(dense.layers, h, rope, mesh, tried_then_kept, progress=False)
    assert seen == ["dense", "dense"] * 3
    plain = layer_pass.layer_pass(dense.layers, *layer_pass.start_pass(dense, calib, mesh), mesh,
                                  lambda inputs: inputs.layer.mlp, progress=False)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))


@pytest.mark.parametrize("shape, blocks", [((40, 37), 4), ((7, 3), 4), ((16, 10), 1), ((5, 12), 3)])
def test_the_gram_from_upper_blocks_is_pt_p(shape, blocks):
    p = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    g = np.asarray(symmetric_gram(jnp.asarray(p), blocks))
    np.testing.assert_array_equal(g, g.T)
    np.testing.assert_allclose(g, p.astype(np.float64).T @ p, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shared, skip, routing", [(6, 0, "top2"), (0, 0, "top1"), (6, 5, "any"), (0, 5, "any")])
def test_the_routed_gram_is_pt_p_over_the_tokens_each_block_runs_on(shared, skip, routing):
    """`routed_normal_equations` gives the upper triangle of P^T P (what `solve_down`
    reads) and P^T y of the dense P, for top-k routing and for a routing where a token may
    run no routed expert or every one (threshold routing)."""
    rng = np.random.default_rng(1)
    t, e, m, d = 50, 4, 3, 5
    if routing == "any":
        weight = np.where(rng.random((t, e)) < 0.5, rng.uniform(0.5, 2, (t, e)), 0.0)
        weight[:3], weight[3:6] = 0.0, 1.5        # tokens that run none, and every one
    else:
        k = int(routing[-1])
        weight = np.zeros((t, e))
        np.put_along_axis(weight, np.argsort(rng.random((t, e)), 1)[:, :k], rng.uniform(0.5, 2, (t, k)), 1)
    weight = weight.astype(np.float32)
    gated = rng.normal(size=(t, e, m)).astype(np.float32) * weight[..., None]
    hs, skipped = (rng.normal(size=(t, w)).astype(np.float32) for w in (shared, skip))
    y = rng.normal(size=(t, d)).astype(np.float32)
    h_all = shared + e * m + skip
    dense = ([(0, hs)] if shared else []) + ([(shared + e * m, skipped)] if skip else [])
    # into the buffers of another window's routing (every token on expert 0 alone), as a fit reuses them
    other = np.zeros_like(weight)
    other[:, 0] = 1.0
    before = routed_normal_equations(dense, rng.normal(size=gated.shape).astype(np.float32) * other[..., None],
                                     other, y, (shared, h_all))
    ptp, pty = routed_normal_equations(dense, gated, weight, y, (shared, h_all), out=before)
    p = np.concatenate([hs, gated.reshape(t, -1), skipped], 1).astype(np.float64)
    np.testing.assert_allclose(np.triu(ptp), np.triu(p.T @ p), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(pty, p.T @ y, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("plan, skip", [("S1A2E8", False), ("S0A1E4", True)])
def test_the_down_fit_on_the_cpu_equals_the_accelerators_dense_gram(monkeypatch, plan, skip):
    """The host's routed Gram (the CPU) and the dense one (an accelerator) fit the same
    down projections."""
    from cmoe_jax.methods.cmoe import carve_ffn, layer_fit
    from tests.test_moe_carve_ffn import dense_ffn

    w, x = dense_ffn(4)
    fit = lambda: carve_ffn(*w, x, plan, activation="silu", down_fit=0.1, skip_compensation=skip)  # noqa: E731
    host = fit()
    monkeypatch.setattr(layer_fit, "on_cpu", lambda mesh: False)
    device = fit()
    names = ("shared_down",) * bool(host.shared_width) + ("expert_down",) + ("skip_down",) * skip
    for name in names:
        a, b = (np.asarray(getattr(layer, name)[...]) for layer in (host, device))
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(b).max()))

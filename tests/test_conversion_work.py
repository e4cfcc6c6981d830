"""What a conversion leaves out to save time changes no result: each converted layer runs
forward over the calibration batch once (the stream its error was measured on is the one
the pass carries on), and the down fit's Gram matrix taken from its upper blocks is P^T P."""
from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cmoe_jax.calibration_pass import layer_pass
from cmoe_jax.convert import ConvertConfig, convert_model
from cmoe_jax.methods.cmoe import MoEPlan
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
    # per layer: the converted FFN for its error, the dense one for the error's reference
    assert seen == ["moe", "dense"] * 3
    assert all(r.error is not None and r.error > 0 for r in records)
    a, b = (jax.tree_util.tree_flatten_with_path(nnx.state(m))[0] for m in (again, once))
    assert [path for path, _ in a] == [path for path, _ in b]
    for (_, x), (_, y) in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


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

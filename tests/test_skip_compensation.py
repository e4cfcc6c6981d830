"""The skipped experts' compensation (`FFNSpec.skip_compensation`, `--skip-compensation`): the
layer adds what the token-by-token numpy reference adds, the fit equals numpy's ridge solution
over the extra columns, and conversions with it stream, export and refuse as the others."""
from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cmoe_jax import carve_ffn
from cmoe_jax.convert import ConvertConfig
from cmoe_jax.methods.cmoe import MoEPlan
from cmoe_jax.methods.cmoe.config import ConversionError
from cmoe_jax.methods.cmoe.convert import check_router
from cmoe_jax.moe import MoEFFN
from tests import moe_numpy
from tests.test_moe_carve_ffn import D, _neuron_features, dense_ffn, numpy_dense


def _layer(skip: bool, **fields):
    fields = dict(dict(router="cmoe", router_neurons=2), **fields)
    return MoEFFN(d_model=16, expert_width=8, num_experts=4, top_k=2, shared_width=8, activation="silu",
                  skip_compensation=skip, rngs=nnx.Rngs(0), **fields)


def test_the_layer_adds_the_skipped_experts_as_the_numpy_reference():
    layer = _layer(True)
    x = np.random.default_rng(1).normal(size=(30, 16)).astype(np.float32)
    plain = _layer(False)
    np.testing.assert_array_equal(np.asarray(layer(jnp.asarray(x))), np.asarray(plain(jnp.asarray(x))))
    layer.skip_down[...] = jnp.asarray(np.random.default_rng(2).normal(size=(8, 16)), jnp.float32)
    want, _, chosen = moe_numpy.forward(layer, x)
    np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x))), want, rtol=1e-4, atol=1e-4)
    assert not np.allclose(want, moe_numpy.forward(plain, x)[0], atol=1e-2)


def test_padding_gets_no_compensation():
    layer = _layer(True)
    layer.skip_down[...] = jnp.ones((8, 16), jnp.float32)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, 16)), jnp.float32)
    mask = jnp.asarray([[True] * 5, [True, True, False, False, False]])
    plain = _layer(False)
    np.testing.assert_allclose(np.asarray(layer(x, mask=mask))[1, 2:], np.asarray(plain(x, mask=mask))[1, 2:],
                               atol=1e-6)


@pytest.mark.parametrize("fields", [dict(router="linear"), dict(sub_experts=2, sub_top_k=1)])
def test_the_term_needs_a_plain_cmoe_router(fields):
    with pytest.raises(ValueError, match="skip_compensation"):
        _layer(True, **fields)


def _skipped_features(moe, t):
    """[T, E r] in float64, token by token: each skipped expert's router neurons' h, 0 for the chosen."""
    p = moe_numpy.params(moe)
    e, rows = moe.num_experts, []
    for xt in t:
        probs = moe_numpy.softmax(moe_numpy.logits(p, xt, "cmoe", e))
        sel = np.argsort(-(probs + p["router_bias"]), kind="stable")[:moe.top_k]
        h = (moe_numpy.silu(xt @ p["router_gate"]) * (xt @ p["router_up"])).reshape(e, -1)
        h[sel] = 0.0
        rows.append(h.ravel())
    return np.stack(rows)


@pytest.mark.parametrize("plan, ridge", [("S1A2E8", 0.01), ("S0A1E4", 0.1)])
def test_the_fit_is_the_ridge_least_squares_with_the_skipped_columns(plan, ridge):
    """skip_down and the down projections equal numpy's ridge solution over [P, skipped h]
    (the skipped h pulled towards 0), and the layer then reconstructs the dense FFN's output on
    the calibration tokens better than without the term."""
    w, x = dense_ffn(4)
    carved = carve_ffn(*w, x, plan, activation="silu", down_fit=0.0, router_neurons=2)
    plain = carve_ffn(*w, x, plan, activation="silu", down_fit=ridge, down_fit_tokens=10_000, router_neurons=2)
    moe = carve_ffn(*w, x, plan, activation="silu", down_fit=ridge, down_fit_tokens=10_000, router_neurons=2,
                    skip_compensation=True)
    t = x.reshape(-1, D).astype(np.float64)
    feats = np.concatenate([_neuron_features(carved, t), _skipped_features(carved, t)], axis=1)
    shared = [np.asarray(carved.shared_down[...], np.float64)] if carved.shared_width else []
    skip_rows = moe.num_experts * 2
    w0 = np.concatenate(shared + [np.asarray(carved.expert_down[...], np.float64).reshape(-1, D),
                                  np.zeros((skip_rows, D))])
    gram = feats.T @ feats
    lam = ridge * np.mean(np.diag(gram))
    want = np.linalg.solve(gram + lam * np.eye(len(gram)), feats.T @ numpy_dense(w, x).reshape(-1, D) + lam * w0)
    shared = [np.asarray(moe.shared_down[...], np.float64)] if moe.shared_width else []
    got = np.concatenate(shared + [np.asarray(moe.expert_down[...], np.float64).reshape(-1, D),
                                   np.asarray(moe.skip_down[...], np.float64)])
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())
    dense = numpy_dense(w, x)
    error = lambda layer: np.square(np.asarray(layer(jnp.asarray(x)), np.float64) - dense).sum()  # noqa: E731
    assert error(moe) < error(plain)


def test_the_term_needs_a_down_fit():
    cfg = ConvertConfig(plan=MoEPlan.parse("S1A2E8"), skip_compensation=True, down_fit=0.0)
    from cmoe_jax.methods.cmoe.carve_ffn import _ffn_config

    with pytest.raises(ConversionError, match="--down-fit"):
        check_router(_ffn_config(D, 96, "silu"), cfg)


def test_the_cli_refuses_it_with_the_paper_router(save_tiny, tmp_path, capsys):
    from cmoe_jax.convert.cli import main as convert_main
    from tests.conftest import save_tiny_tokenizer, write_random_text

    _, path = save_tiny("llama", intermediate_size=64)
    save_tiny_tokenizer(path)
    text = write_random_text(tmp_path / "calib.txt", 2000)
    code = convert_main(["--model", str(path), "--config", "S1A2E8", "--data-path", str(text), "--paper-router",
                         "--skip-compensation", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1] == "error: --paper-router sets the router itself: drop --skip-compensation"
    assert not (tmp_path / "out").exists()


def test_a_streamed_conversion_with_the_term_equals_in_memory_and_counts_its_cost(save_tiny, tmp_path):
    from tests.test_convert_streamed import _assert_same_state, memory_and_streamed

    cc = ConvertConfig(plan=MoEPlan.parse("S1A2E8"), k_act=4, router_neurons=2, skip_compensation=True)
    (a, b), (memory, streamed) = memory_and_streamed(save_tiny, tmp_path, cc)
    assert a["layers"] == b["layers"]
    # 7 routed experts x 2 router neurons x d, against the dense FFN's 3 d d_h (d_h = 64)
    assert a["active_share"] == pytest.approx(3 / 8 + 7 * 2 / (3 * 64))
    assert a["down_fit"]["skip_compensation"] is True
    _assert_same_state(memory, streamed)
    assert all(s.skip_compensation for s in memory.config.moe_layers)
    skip = [np.asarray(layer.mlp.skip_down[...]) for layer in memory.unstacked().layers]
    assert all(np.abs(s).max() > 0 for s in skip)

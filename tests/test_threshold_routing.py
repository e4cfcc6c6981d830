"""Threshold routing (`FFNSpec.threshold_routing`, `--routing threshold`): a token runs those
of its `top_k` best-scored experts whose score reaches the layer's fitted threshold. The layer
equals the token-by-token numpy reference on every dispatch path, the threshold is the
quantile that gives the plan's mean on the calibration tokens, the fits use the same routing,
and conversions with it stream, record it and refuse what cannot take it."""
from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cmoe_jax import carve_ffn
from cmoe_jax.convert import ConvertConfig
from cmoe_jax.methods.cmoe import MoEPlan
from cmoe_jax.moe import MoEFFN
from tests import moe_numpy
from tests.test_moe_carve_ffn import D, assert_ridge_down, dense_ffn, numpy_dense


def _layer(**fields):
    fields = dict(dict(router="cmoe", router_neurons=2, threshold_routing=True), **fields)
    return MoEFFN(d_model=16, expert_width=8, num_experts=4, top_k=3, shared_width=8, activation="silu",
                  rngs=nnx.Rngs(0), **fields)


def _scores(layer, x):
    p = moe_numpy.params(layer)
    return np.stack([moe_numpy.logits(p, xt, "cmoe", layer.num_experts) for xt in np.asarray(x, np.float64)])


@pytest.mark.parametrize("dispatch", ["sort", "gather", "dense", "padded"])
@pytest.mark.parametrize("skip", [False, True])
def test_the_layer_runs_the_chosen_experts_above_the_threshold_as_numpy(dispatch, skip):
    layer = _layer(dispatch=dispatch, skip_compensation=skip)
    x = np.random.default_rng(1).normal(size=(40, 16)).astype(np.float32)
    layer.u[...] = jnp.linspace(-1.0, 1.0, 4)
    if skip:
        layer.skip_down[...] = jnp.asarray(np.random.default_rng(2).normal(size=(8, 16)), jnp.float32)
    layer.router_threshold[...] = jnp.full((1,), np.median(_scores(layer, x)), jnp.float32)
    y, load = layer(jnp.asarray(x), return_load=True)
    want, want_load, chosen = moe_numpy.forward(layer, x)
    ran = (chosen < 4).sum(1)
    assert ran.min() < ran.max() <= 3  # tokens run different numbers of experts, at most top_k
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(load), want_load)


def test_a_fresh_layer_runs_its_top_k():
    """The threshold starts at 0, which every score reaches: the plain top-k layer."""
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, 16)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(_layer()(x)), np.asarray(_layer(threshold_routing=False)(x)))


@pytest.mark.parametrize("fields", [dict(router="linear"), dict(sub_experts=2, sub_top_k=1)])
def test_threshold_routing_needs_a_plain_cmoe_router(fields):
    with pytest.raises(ValueError, match="threshold_routing"):
        _layer(**fields)


def _features(moe, t):
    """P [T, H], token by token in float64, with the threshold's selection: shared h, then each
    expert's h times the token's gate (0 for an expert not run)."""
    p = moe_numpy.params(moe)
    act, e = moe_numpy.silu, moe.num_experts
    rows = []
    for xt in t:
        scores = moe_numpy.logits(p, xt, "cmoe", e)
        probs = moe_numpy.softmax(scores)
        # top_k is every routed expert here; the threshold is one pair's float32 score, which
        # float64 may put a hair below it: that pair runs
        run = scores >= p["router_threshold"][0] * (1 - 1e-5)
        gate = np.where(run, 1.0 + probs * p["u"], 0.0)
        shared = act(xt @ p["shared_gate"]) * (xt @ p["shared_up"]) if "shared_gate" in p else np.zeros(0)
        rows.append(np.concatenate([shared, *[gate[j] * act(xt @ p["expert_gate"][j]) * (xt @ p["expert_up"][j])
                                              for j in range(e)]]))
    return np.stack(rows)


@pytest.mark.parametrize("plan", ["S1A2E8", "S2A3E6"])
def test_the_fits_route_by_the_fitted_threshold(plan):
    """The threshold is the (T y)-th largest score of the calibration tokens, so they run y
    routed experts on average; the down projections are numpy's ridge solution over the
    threshold's selection."""
    w, x = dense_ffn(4)
    ridge = 0.01
    moe = carve_ffn(*w, x, plan, activation="silu", down_fit=ridge, down_fit_tokens=10_000, routing="threshold")
    active = MoEPlan.parse(plan).active
    assert moe.top_k == moe.num_experts and moe.spec.threshold_routing
    t = x.reshape(-1, D).astype(np.float64)
    scores = _scores(moe, t)
    threshold = float(moe.router_threshold[0])
    assert threshold == pytest.approx(np.sort(scores.ravel())[::-1][len(t) * active - 1], rel=1e-5)
    assert np.sum(np.abs(scores / threshold - 1) < 1e-5) == 1  # no other pair near it
    _, load = moe(jnp.asarray(x), return_load=True)
    assert int(np.asarray(load).sum()) == len(t) * active
    carved = carve_ffn(*w, x, plan, activation="silu", down_fit=0.0, routing="threshold")
    for name in ("router_gate", "router_up", "u", "router_threshold"):  # the routing the fit saw
        np.testing.assert_array_equal(np.asarray(getattr(moe, name)[...]), np.asarray(getattr(carved, name)[...]))
    assert_ridge_down(moe, carved, _features(carved, t), numpy_dense(w, x).reshape(-1, D), ridge)


def test_the_cli_refuses_it_with_the_paper_router(save_tiny, tmp_path, capsys):
    from cmoe_jax.convert.cli import main as convert_main
    from tests.conftest import save_tiny_tokenizer, write_random_text

    _, path = save_tiny("llama", intermediate_size=64)
    save_tiny_tokenizer(path)
    text = write_random_text(tmp_path / "calib.txt", 2000)
    code = convert_main(["--model", str(path), "--config", "S1A2E8", "--data-path", str(text), "--paper-router",
                         "--routing", "threshold", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1] == "error: --paper-router sets the router itself: drop --routing"
    assert not (tmp_path / "out").exists()


def test_a_streamed_conversion_with_it_equals_in_memory_and_records_it(save_tiny, tmp_path):
    from tests.test_convert_streamed import _assert_same_state, memory_and_streamed

    cc = ConvertConfig(plan=MoEPlan.parse("S1A2E8"), k_act=4, router_neurons=2, routing="threshold")
    (a, b), (memory, streamed) = memory_and_streamed(save_tiny, tmp_path, cc)
    assert a["layers"] == b["layers"] and a["router"]["routing"] == "threshold"
    assert a["active_share"] == pytest.approx(3 / 8)
    # the calibration tokens ran 2 routed experts each on average, in every layer
    assert all(sum(layer["load"]) == 2 * 2 * 32 for layer in a["layers"])
    _assert_same_state(memory, streamed)
    assert all(s.threshold_routing and s.top_k == 7 for s in memory.config.moe_layers)


def test_the_threshold_is_state_that_no_optimiser_moves():
    """A `RouterThreshold`, not an `nnx.Param`: an optimiser over the parameters (weight
    decay included) never sees it."""
    from cmoe_jax.moe import RouterThreshold

    layer = _layer()
    assert isinstance(layer.router_threshold, RouterThreshold)
    assert "router_threshold" not in nnx.to_pure_dict(nnx.state(layer, nnx.Param))

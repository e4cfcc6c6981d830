"""CMoE conversion end to end on tiny random Llamas: exactness, routing, determinism,
data parallelism, bad input and resumption."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cmoe_jax.methods.cmoe import MoEPlan, split_shared
from cmoe_jax.convert import Calibration, ConvertConfig, ConvertSettings, convert, convert_model
from cmoe_jax.convert.cli import main as convert_main
from cmoe_jax.loading import load_model

from conftest import xla_flags

ROOT = Path(__file__).resolve().parents[1]


def _calib(n=4, t=32, vocab=96, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=(n, t)).astype(np.int32)


@pytest.fixture
def dense(save_tiny):
    _, path = save_tiny("llama", intermediate_size=64)
    return load_model(str(path), progress=False).model


def test_all_experts_active_reproduces_dense(dense):
    cc = ConvertConfig(plan=MoEPlan.parse("S2A6E8"), k_act=4)
    moe, records = convert_model(dense, _calib(), cc, progress=False)
    tokens = jnp.asarray(_calib(2, 24, seed=5))
    np.testing.assert_allclose(np.asarray(moe(tokens)), np.asarray(dense(tokens)), atol=1e-4)
    for r in records:  # a partition of all neurons
        ids = np.concatenate([r.carving.shared_idx, np.ravel(r.carving.expert_idx)])
        assert sorted(ids.tolist()) == list(range(64))


def test_shared_experts_are_top_mu_neurons(dense):
    """The paper's rule (`shared_by="rate"`)."""
    cc = ConvertConfig(plan=MoEPlan.parse("S2A2E8"), k_act=4, shared_by="rate")
    _, records = convert_model(dense, _calib(), cc, progress=False)
    for r in records:
        shared = np.asarray(r.carving.shared_idx)
        assert r.mu[shared].min() >= np.delete(r.mu, shared).max()


def test_rate_ties_go_to_the_higher_output_energy():
    """Rate-0 (or equal-rate) neurons at the edge of the shared set, and of the initial
    centroids, are chosen by output energy, whatever their ids."""
    mu = np.array([0.5, 0.0, 0.0, 0.2, 0.0, 0.2, 0.0, 0.0])
    energy = np.array([9.0, 1.0, 5.0, 2.0, 3.0, 7.0, 4.0, 0.5])
    shared, rest, init = split_shared(mu, 3, 2, tie_score=energy)
    np.testing.assert_array_equal(shared, [0, 3, 5])
    np.testing.assert_array_equal(init, [2, 6])            # rate 0: energies 5 and 4
    perm = np.random.default_rng(0).permutation(8)         # relabelled neurons, same choice
    s2, _, i2 = split_shared(mu[perm], 3, 2, tie_score=energy[perm])
    np.testing.assert_array_equal(np.sort(perm[s2]), shared)
    np.testing.assert_array_equal(perm[i2], init)


def test_shared_experts_and_router_neurons_by_output_energy(dense):
    """`shared_by="energy"`: the neurons of largest mean h^2 * ||W_down row||^2, recomputed in
    numpy from the first layer's FFN inputs (the dense model's, since nothing precedes it);
    `router_reps="energy"`: each expert's router neurons are its members of largest energy."""
    calib = _calib()
    cc = ConvertConfig(plan=MoEPlan.parse("S2A2E8"), k_act=4, shared_by="energy",
                       router_reps="energy", router_neurons=3)
    _, records = convert_model(dense, calib, cc, progress=False)
    _, captured = dense(jnp.asarray(calib), capture_ffn_inputs=True)
    x = np.asarray(captured[0], np.float64).reshape(-1, 32)
    mlp = dense.layers[0].mlp
    wg, wu, wd = (np.asarray(w[...], np.float64) for w in (mlp.gate, mlp.up, mlp.down))
    g = x @ wg
    h = g / (1 + np.exp(-g)) * (x @ wu)
    energy = (h ** 2).mean(axis=0) * (wd ** 2).sum(axis=1)
    shared = np.asarray(records[0].carving.shared_idx)
    np.testing.assert_array_equal(shared, np.sort(np.argsort(-energy)[: len(shared)]))
    rate_rule = np.sort(np.argsort(-records[0].mu, kind="stable")[: len(shared)])
    assert not np.array_equal(shared, rate_rule)  # the two rules differ on this model
    for members, reps in zip(records[0].carving.expert_idx, records[0].carving.representative_idx):
        np.testing.assert_array_equal(reps, np.asarray(members)[np.argsort(-energy[members])[:3]])


def test_router_picks_experts_with_largest_representative_activation(dense):
    """The paper's router: one representative per expert, raw |h| scores."""
    plan = MoEPlan.parse("S1A2E8")
    cc = ConvertConfig(plan=plan, k_act=4, router_neurons=1, router_scale=False, gate_fit=False,
                       down_fit=0.0)
    moe, records = convert_model(dense, _calib(), cc, progress=False)
    layer, dense_mlp, carving = moe.layers[0].mlp, dense.layers[0].mlp, records[0].carving
    x = jax.random.normal(jax.random.key(0), (64, 32))
    wg, wu, wd = (np.asarray(dense_mlp.gate[...]), np.asarray(dense_mlp.up[...]),
                  np.asarray(dense_mlp.down[...]))
    xn = np.asarray(x)
    rep = np.asarray(carving.representative_idx).ravel()
    rg = wg[:, rep] / np.linalg.norm(wg[:, rep], axis=0)
    ru = wu[:, rep] / np.linalg.norm(wu[:, rep], axis=0)
    a = xn @ rg
    scores = np.abs(a / (1 + np.exp(-a)) * (xn @ ru))
    top = np.argsort(-scores, axis=1, kind="stable")[:, : plan.active]

    def neurons_out(idx, rows):
        h = xn[rows] @ wg[:, idx]
        return (h / (1 + np.exp(-h)) * (xn[rows] @ wu[:, idx])) @ wd[idx]

    expected = np.stack([
        neurons_out(np.asarray(carving.shared_idx), [t])[0]
        + sum(neurons_out(np.asarray(carving.expert_idx)[e], [t])[0] for e in top[t])
        for t in range(x.shape[0])])
    np.testing.assert_allclose(np.asarray(layer(x)), expected, atol=1e-4)


def _silu(a):
    return a / (1 + np.exp(-a))


def test_router_sums_several_neurons_with_least_squares_scales(dense):
    """r = 4 closest neurons per expert, |h| summed, times c_j fitted by least squares of the
    scores against the experts' output norms on the calibration inputs."""
    plan, calib = MoEPlan.parse("S1A2E8"), _calib()
    cc = ConvertConfig(plan=plan, k_act=4, router_neurons=4, router_reps="centroid", gate_fit=False,
                       down_fit=0.0)
    moe, records = convert_model(dense, calib, cc, progress=False)
    layer, dmlp, carving = moe.layers[0].mlp, dense.layers[0].mlp, records[0].carving
    wg, wu, wd = (np.asarray(w[...], np.float64) for w in (dmlp.gate, dmlp.up, dmlp.down))
    reps, experts = np.asarray(carving.representative_idx), np.asarray(carving.expert_idx)
    assert reps.shape == (7, 4) and all(set(r) <= set(e) for r, e in zip(reps, experts))
    d0 = dense.layers[0]
    x_cal = np.asarray(d0.ffn_input(d0.attention_block(dense.embed_tokens(jnp.asarray(calib)),
                                                       dense.rope(calib.shape[1]))), np.float64)
    x_cal = x_cal.reshape(-1, x_cal.shape[-1])

    def raw_scores(x):
        rg = wg[:, reps.ravel()] / np.linalg.norm(wg[:, reps.ravel()], axis=0)
        ru = wu[:, reps.ravel()] / np.linalg.norm(wu[:, reps.ravel()], axis=0)
        return np.abs(_silu(x @ rg) * (x @ ru)).reshape(len(x), 7, 4).sum(-1)

    def expert_out(x, idx):
        return (_silu(x @ wg[:, idx]) * (x @ wu[:, idx])) @ wd[idx]

    s = raw_scores(x_cal)
    y = np.stack([np.linalg.norm(expert_out(x_cal, e), axis=1) for e in experts], axis=1)
    c = (s * y).sum(0) / (s * s).sum(0)
    np.testing.assert_allclose(records[0].router_scales, c, rtol=1e-4)
    x = np.asarray(jax.random.normal(jax.random.key(1), (64, 32)), np.float64)
    top = np.argsort(-(raw_scores(x) * c), axis=1, kind="stable")[:, :2]
    expected = np.stack([expert_out(x[t:t + 1], carving.shared_idx)[0]
                         + sum(expert_out(x[t:t + 1], experts[e])[0] for e in top[t])
                         for t in range(len(x))])
    np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x, jnp.float32))), expected, atol=1e-4)


def test_defaults_are_sixteen_energy_router_neurons_and_paper_router_one_flag_away(
        tiny_checkpoint, tmp_path):
    cc = ConvertConfig(plan=MoEPlan.parse("S1A1E8"))
    assert (cc.neurons_for(192), cc.router_reps, cc.router_scale, cc.shared_by, cc.gate_fit, cc.down_fit) == (
        16, "energy", True, "rate-energy", True, 0.1)
    assert cc.neurons_for(8) == 8  # capped at a narrower expert
    _, path, text = tiny_checkpoint
    assert convert_main(_cli(path, text, tmp_path / "default", "--config", "S1A1E4")) == 0
    router = json.loads((tmp_path / "default" / "cmoe_manifest.json").read_text())["router"]
    assert router["neurons_per_expert"] == 16  # the tiny model's experts are 16 wide
    assert convert_main(_cli(path, text, tmp_path / "paper", "--config", "S1A1E8", "--paper-router")) == 0
    router = json.loads((tmp_path / "paper" / "cmoe_manifest.json").read_text())["router"]
    assert (router["neurons_per_expert"], router["representatives_by"], router["fitted_scales"],
            router["fitted_gates"]) == (1, "centroid", False, False)
    assert json.loads((tmp_path / "paper" / "cmoe_manifest.json").read_text())["down_fit"]["ridge"] == 0.0


def test_paper_router_flag_refuses_other_router_flags(tiny_checkpoint, tmp_path, capsys):
    _, path, text = tiny_checkpoint
    argv = _cli(path, text, tmp_path / "x", "--config", "S1A1E8", "--paper-router", "--router-neurons", "4")
    assert convert_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--paper-router" in err[0] and "--router-neurons" in err[0]
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()


def test_same_seed_same_partition_bit_for_bit(dense):
    cc = ConvertConfig(plan=MoEPlan.parse("S1A1E8"), k_act=4, seed=3)
    m1, r1 = convert_model(dense, _calib(), cc, progress=False)
    m2, r2 = convert_model(dense, _calib(), cc, progress=False)
    for a, b in zip(r1, r2):
        np.testing.assert_array_equal(a.carving.expert_idx, b.carving.expert_idx)
        np.testing.assert_array_equal(a.carving.representative_idx, b.carving.representative_idx)
    for (p, x), (_, y) in zip(nnx.to_flat_state(nnx.state(m1)), nnx.to_flat_state(nnx.state(m2))):
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()), err_msg=str(p))


_MULTI_DEVICE_SCRIPT = """
import sys, json, numpy as np, jax
sys.path.insert(0, {root!r})
import cmoe_jax.moe.expert_parallel as ep
from cmoe_jax.methods.cmoe import MoEPlan
from cmoe_jax.convert import ConvertConfig, convert_model
from cmoe_jax.loading import load_model
exchanges = []
_exchange = ep._exchange
ep._exchange = lambda *a, **k: exchanges.append(a[5]) or _exchange(*a, **k)  # traced all-to-all
dense = load_model({path!r}, progress=False).model
calib = np.random.default_rng(0).integers(0, 96, size=(8, 32)).astype(np.int32)
moe, recs = convert_model(dense, calib, ConvertConfig(plan=MoEPlan.parse("S2A2E8"), k_act=4),
                          progress=False, expert_parallel={expert})
tokens = np.random.default_rng(1).integers(0, 96, size=(2, 16)).astype(np.int32)
np.savez({out!r}, logits=np.asarray(moe(tokens)), experts=np.stack([r.carving.expert_idx for r in recs]),
         loads=np.stack([r.load for r in recs]), devices=len(jax.devices()), exchanges=len(exchanges))
"""


def test_eight_device_conversion_equals_one_device(save_tiny, tmp_path):
    """1 device, 8 data-parallel devices, and 4 data x 2 expert-parallel devices (the routed
    experts of each converted layer split over 2 devices, tokens exchanged by all-to-all):
    the same partitions, expert loads and logits."""
    _, path = save_tiny("llama", intermediate_size=64)
    results = {}
    for n, expert in ((1, 1), (8, 1), (8, 2)):
        out = tmp_path / f"r{n}_{expert}.npz"
        env = dict(os.environ, XLA_FLAGS=xla_flags(n), JAX_PLATFORMS="cpu")
        script = _MULTI_DEVICE_SCRIPT.format(root=str(ROOT), path=str(path), out=str(out), expert=expert)
        subprocess.run([sys.executable, "-c", script], check=True, env=env)
        results[n, expert] = np.load(out)
    one = results[1, 1]
    assert int(one["devices"]) == 1 and int(results[8, 1]["devices"]) == 8
    assert int(one["exchanges"]) == int(results[8, 1]["exchanges"]) == 0
    assert int(results[8, 2]["exchanges"]) > 0  # the converted layers ran expert-parallel
    for key in ((8, 1), (8, 2)):
        np.testing.assert_array_equal(one["experts"], results[key]["experts"])
        np.testing.assert_array_equal(one["loads"], results[key]["loads"])
        np.testing.assert_allclose(one["logits"], results[key]["logits"], atol=1e-5)


# ---- the CLI: bad input fails before any work, nothing written --------------------------

def _cli(path, text, out, *extra):
    return ["--model", str(path), "--calib", "wikitext2", "--data-path", str(text),
            "--calib-samples", "2", "--seqlen", "32", "--k-act", "4", "--out", str(out), *extra]


@pytest.mark.parametrize("extra, message", [
    (["--config", "S1A1E7"], "divide"),
    (["--config", "S1A8E8"], "active"),
    (["--config", "S8A0E8"], "shared"),
    (["--config", "S1A1E8", "--k-act", "100"], "K_a"),
    (["--config", "S1A1E8", "--seqlen", "100000"], "context"),
    (["--config", "S1A1E8", "--expert-parallel", "7"], "local devices"),
    (["--config", "S1A2E4", "--expert-parallel", "2"], "does not divide the 3 routed experts"),
    (["--config", "S1A1E8", "--shared-by", "profile"], "--shared-by profile"),
])
def test_cli_rejects_bad_plans(tiny_checkpoint, tmp_path, capsys, extra, message):
    _, path, text = tiny_checkpoint
    out = tmp_path / "out"
    assert convert_main(_cli(path, text, out) + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err, err
    assert not out.exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("bad, flag", [(dict(router_reps="nearest"), "--router-reps"),
                                       (dict(shared_by="norm"), "--shared-by"),
                                       (dict(router_neurons=0), "--router-neurons")])
def test_api_rejects_bad_router_and_shared_rules(dense, bad, flag):
    from cmoe_jax.methods.cmoe.convert import ConversionError

    with pytest.raises(ConversionError, match=flag):
        convert_model(dense, _calib(), ConvertConfig(plan=MoEPlan.parse("S1A1E8"), **bad),
                      progress=False)


def test_cli_rejects_short_calibration(tiny_checkpoint, tmp_path, capsys):
    _, path, _ = tiny_checkpoint
    short = tmp_path / "short.txt"
    short.write_text("w1 w2 w3\n")
    out = tmp_path / "out"
    assert convert_main(_cli(path, short, out, "--config", "S1A1E8")) == 2
    assert "window" in capsys.readouterr().err
    assert not out.exists()


def test_cli_rejects_existing_output(tiny_checkpoint, tmp_path, capsys):
    _, path, text = tiny_checkpoint
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert convert_main(_cli(path, text, out, "--config", "S1A1E8")) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"


def test_nan_activations_rejected(tiny_checkpoint, tmp_path, capsys):
    model, path, text = tiny_checkpoint
    import torch

    with torch.no_grad():
        model.model.layers[0].post_attention_layernorm.weight[0] = float("nan")
    bad = tmp_path / "nan_model"
    model.save_pretrained(bad)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (bad / f).write_bytes((path / f).read_bytes())
    out = tmp_path / "out"
    assert convert_main(_cli(bad, text, out, "--config", "S1A1E8")) == 2
    assert "NaN" in capsys.readouterr().err
    assert not out.exists()


def test_cli_converts_and_eval_loads(tiny_checkpoint, tmp_path):
    _, path, text = tiny_checkpoint
    out = tmp_path / "out"
    assert convert_main(_cli(path, text, out, "--config", "S1A1E8", "--report")) == 0
    manifest = json.loads((out / "cmoe_manifest.json").read_text())
    assert manifest["config"] == "S1A1E8" and len(manifest["layers"]) == 2
    assert len(manifest["layers"][0]["experts"]) == 7 and len(manifest["layers"][0]["shared"]) == 8
    assert (out / "report" / "activation_rates.png").exists()
    assert (out / "report" / "expert_load.png").exists()
    report = json.loads((out / "report" / "report.json").read_text())
    assert sum(report["layers"][0]["load_per_expert"]) == 2 * 32  # one routed expert per token
    lm = load_model(str(out), progress=False)
    assert lm.config.moe_layers[0].router == "cmoe"
    tokens = jnp.asarray(_calib()[:1, :16])
    logits = lm.model(tokens)
    assert logits.shape == (1, 16, 96)
    # bfloat16: the MoE layers compute in it too, not only store their weights in it
    bf16 = load_model(str(out), dtype=jnp.bfloat16, progress=False).model
    assert all(layer.mlp.dtype == jnp.bfloat16 and layer.mlp.expert_gate[...].dtype == jnp.bfloat16
               for layer in bf16.layers)
    np.testing.assert_allclose(np.asarray(bf16(tokens), np.float32), np.asarray(logits), atol=0.1)


def test_interrupted_conversion_resumes_identically(tiny_checkpoint, tmp_path):
    _, path, text = tiny_checkpoint
    job = ConvertSettings(ConvertConfig(plan=MoEPlan.parse("S1A2E8"), k_act=4),
                     Calibration(data_path=str(text), samples=2, seqlen=32))
    full = tmp_path / "full"
    convert(str(path), job, out=full, progress=False)
    out = tmp_path / "resumed"
    r = convert(str(path), job, out=out, stop_after_layers=1, progress=False)
    assert r["out"] is None and not out.exists()  # no partial checkpoint at the output path
    assert (tmp_path / "resumed.partial" / "layers" / "0000.json").exists()
    convert(str(path), job, out=out, resume=True, progress=False)
    assert not (tmp_path / "resumed.partial").exists()
    a, b = json.loads((full / "cmoe_manifest.json").read_text()), json.loads((out / "cmoe_manifest.json").read_text())
    assert a["layers"] == b["layers"]
    ma, mb = load_model(str(full), progress=False).model, load_model(str(out), progress=False).model
    for (p, x), (_, y) in zip(nnx.to_flat_state(nnx.state(ma)), nnx.to_flat_state(nnx.state(mb))):
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()), err_msg=str(p))


def test_oracle_router_of_the_layer_error_benchmark_matches_brute_force(dense):
    """`benchmarks/ffn_layer_error.oracle_outputs`: per token the top_k routed experts by true
    output norm plus the shared MLP, recomputed expert by expert in numpy; all experts together
    are the dense FFN; the hit rate counts the router's picks among the oracle's."""
    from benchmarks.ffn_layer_error import oracle_outputs

    moe, _ = convert_model(dense, _calib(), ConvertConfig(plan=MoEPlan.parse("S1A2E8"), k_act=4, down_fit=0.0),
                           progress=False)
    mlp, x = moe.layers[0].mlp, np.random.default_rng(3).normal(size=(12, 32)).astype(np.float32)
    oracle, everything, hit = jax.jit(oracle_outputs)(mlp, jnp.asarray(x))
    w = [np.asarray(getattr(mlp, n)[...], np.float64) for n in ("expert_gate", "expert_up", "expert_down")]
    xs = x.astype(np.float64)
    outs = np.stack([(xs @ w[0][e] / (1 + np.exp(-(xs @ w[0][e]))) * (xs @ w[1][e])) @ w[2][e]
                     for e in range(mlp.num_experts)], 1)                  # [T, E, d]
    best = np.argsort(-np.linalg.norm(outs, axis=-1), axis=1)[:, :mlp.top_k]
    shared = np.asarray(mlp.shared(jnp.asarray(x)), np.float64)
    want = shared + np.stack([outs[t, best[t]].sum(0) for t in range(len(x))])
    np.testing.assert_allclose(np.asarray(oracle), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(everything), np.asarray(dense.layers[0].mlp(jnp.asarray(x))),
                               rtol=1e-4, atol=1e-5)
    ids = np.asarray(mlp.route(jnp.asarray(x))[0])
    want_hit = np.mean([len(set(ids[t]) & set(best[t])) / mlp.top_k for t in range(len(x))])
    assert float(hit) == pytest.approx(want_hit)

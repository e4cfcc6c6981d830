"""The methods on the newer families (tiny random models): CMoE and ExpertWeaver on Gemma 3
(its GELU-tanh GLU through every expert, router and profile) and Mistral; hierarchical CMoE
and ConMoE on OLMoE and Qwen2-MoE, whose shared expert is never merged or dropped."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from cmoe_jax.convert import ConvertConfig, convert_model
from cmoe_jax.loading import load_model
from cmoe_jax.methods.cmoe import MoEPlan
from cmoe_jax.methods.conmoe import (apply_plans, baseline_plans, collect_stats, conmoe_plans,
                                     materialize, routed_bytes)
from cmoe_jax.methods.hierarchical.convert import convert_moe_model
from cmoe_jax.models.stack import layer_value

CALIB = np.random.default_rng(0).integers(0, 96, (4, 32)).astype(np.int32)
TOKENS = np.random.default_rng(5).integers(0, 96, (2, 24)).astype(np.int32)


def _hf_logits(hf):
    with torch.no_grad():
        return hf(torch.from_numpy(TOKENS.astype(np.int64))).logits.numpy()


@pytest.mark.parametrize("family", ["gemma3_text", "mistral"])
def test_cmoe_with_every_expert_active_is_the_dense_model(save_tiny, family):
    hf, path = save_tiny(family, intermediate_size=64)
    dense = load_model(str(path), progress=False).model
    moe, _ = convert_model(dense, CALIB, ConvertConfig(plan=MoEPlan.parse("S2A6E8"), k_act=4),
                           progress=False)
    assert moe.config.activation == dense.config.activation
    np.testing.assert_allclose(np.asarray(moe(jnp.asarray(TOKENS))), _hf_logits(hf), atol=1e-4)


def test_cmoe_router_and_experts_use_the_gemma_activation(save_tiny):
    """A partly active Gemma 3 layer against numpy with GELU-tanh: router scores
    |gelu(x R_g) * (x R_u)|, softmax, top-k of p + b, gates 1 + p u, shared MLP plus experts."""
    _, path = save_tiny("gemma3_text", intermediate_size=64)
    dense = load_model(str(path), progress=False).model
    moe, _ = convert_model(dense, CALIB, ConvertConfig(plan=MoEPlan.parse("S2A2E8"), k_act=4),
                           progress=False)
    ffn = moe.unstacked().layers[0].mlp
    ffn.u[...] = jnp.linspace(-1.0, 1.0, ffn.num_experts)
    x = np.random.default_rng(2).standard_normal((5, 32)).astype(np.float32)
    p = {k: np.asarray(getattr(ffn, k)[...], np.float64) for k in (
        "router_gate", "router_up", "u", "shared_gate", "shared_up", "shared_down",
        "expert_gate", "expert_up", "expert_down")}
    gelu = lambda a: 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a ** 3)))
    glu = lambda v, g, u, d: (gelu(v @ g) * (v @ u)) @ d
    want = []
    for v in x.astype(np.float64):
        s = np.abs(gelu(v @ p["router_gate"]) * (v @ p["router_up"])).reshape(ffn.num_experts, -1).sum(-1)
        prob = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        y = glu(v, p["shared_gate"], p["shared_up"], p["shared_down"])
        for e in np.argsort(-prob, kind="stable")[:ffn.top_k]:
            y = y + (1 + prob[e] * p["u"][e]) * glu(v, p["expert_gate"][e], p["expert_up"][e],
                                                     p["expert_down"][e])
        want.append(y)
    np.testing.assert_allclose(np.asarray(ffn(jnp.asarray(x))), np.array(want), atol=1e-5)


def test_expertweaver_with_every_expert_active_is_the_dense_gemma(save_tiny):
    from cmoe_jax.methods.expertweaver import WeaveConfig, weave_model

    hf, path = save_tiny("gemma3_text", intermediate_size=64)
    dense = load_model(str(path), progress=False).model
    tasks = np.repeat(np.arange(2), 2)
    moe, _ = weave_model(dense, CALIB, tasks, WeaveConfig(experts=8, sparsity=0.0), progress=False)
    np.testing.assert_allclose(np.asarray(moe(jnp.asarray(TOKENS))), _hf_logits(hf), atol=2e-4)


@pytest.fixture(params=["olmoe", "qwen2_moe"])
def shared_moe(request, save_tiny):
    hf, path = save_tiny(request.param)
    return hf, load_model(str(path), progress=False).model


def test_hierarchical_every_sub_expert_active_equals_the_source(shared_moe):
    hf, model = shared_moe
    hier, _ = convert_moe_model(model, CALIB, ConvertConfig(plan=MoEPlan(1, 3, 4), k_act=4,
                                                            router_neurons=2), progress=False)
    assert any(s is not None and s.sub_experts == 4 for s in hier.config.moe_layers)
    np.testing.assert_allclose(np.asarray(hier(jnp.asarray(TOKENS))), _hf_logits(hf), atol=1e-4)


SHARED = ("shared_gate", "shared_up", "shared_down", "shared_gate_kernel")


@pytest.mark.parametrize("method", ["conmoe", "frequency", "reap", "msmoe", "hcsmoe"])
def test_conmoe_and_baselines_shrink_and_keep_the_shared_expert(shared_moe, method):
    _, model = shared_moe
    stats = collect_stats(model, CALIB[:2], progress=False)
    if method == "conmoe":
        plans, _ = conmoe_plans(model, stats, 0.5, 1, "adaptive")
    else:
        plans = baseline_plans(method, stats, 0.5, model)
    runtime = apply_plans(model, plans)
    assert routed_bytes(runtime) < routed_bytes(model)
    for l, spec in enumerate(model.config.moe_layers):
        for name in SHARED if spec is not None and spec.shared_width else ():
            np.testing.assert_array_equal(np.asarray(layer_value(runtime, l, "mlp", name)),
                                          np.asarray(layer_value(model, l, "mlp", name)))
    if all((p.slot_maps[l] >= 0).all() for p in plans for l in p.layers):
        copied = materialize(model, plans)
        np.testing.assert_allclose(np.asarray(runtime(jnp.asarray(TOKENS))),
                                   np.asarray(copied(jnp.asarray(TOKENS))), atol=2e-5)


@pytest.mark.parametrize("calib_bos, bos", [(True, 1), (False, None)])
def test_calib_bos_opens_gemma_windows_as_its_evaluation_windows(save_tiny, tmp_path, calib_bos, bos):
    """With `--calib-bos` (`Calibration(bos=True)`) the job calibrates Gemma on windows opened
    with its BOS (1 here), without it on plain ones: its model equals `convert_model` on the
    windows built directly, and the manifest names the token."""
    import json

    from flax import nnx

    from cmoe_jax.checkpoint import restore_model
    from cmoe_jax.convert import Calibration, ConvertSettings, convert
    from cmoe_jax.data import calibration_windows, load_text_tokens
    from tests.conftest import save_tiny_tokenizer, write_random_text

    _, path = save_tiny("gemma3_text", intermediate_size=64)
    save_tiny_tokenizer(path)
    text = write_random_text(tmp_path / "calib.txt", 2000)
    cc = ConvertConfig(plan=MoEPlan.parse("S1A2E8"), k_act=4)
    convert(str(path), ConvertSettings(cc, Calibration(data_path=str(text), samples=2, seqlen=32, bos=calib_bos)),
            out=tmp_path / "out", progress=False)
    assert json.loads((tmp_path / "out" / "cmoe_manifest.json").read_text())["calibration"]["bos"] == bos
    lm = load_model(str(path), progress=False)
    windows = calibration_windows(load_text_tokens("wikitext2", lm.tokenizer, data_path=str(text)), 2, 32, 0, bos=bos)
    assert (windows[:, 0] == 1).all() == calib_bos
    direct, _ = convert_model(lm.model, windows, cc, progress=False)
    got = nnx.to_flat_state(nnx.state(restore_model(tmp_path / "out", stack=False)))
    want = dict(nnx.to_flat_state(nnx.state(direct.unstacked())))
    assert len(got) == len(want)
    for key, value in got:
        np.testing.assert_array_equal(np.asarray(value.get_value()), np.asarray(want[key].get_value()), err_msg=str(key))


def test_calib_bos_on_a_family_of_plain_windows_is_refused_before_any_work(tmp_path, capsys):
    """`--calib-bos` on a Llama (plain evaluation windows): one error line naming the flag, and
    no output directory."""
    from cmoe_jax.convert.cli import main as convert_main
    from tests.conftest import save_tiny_tokenizer, tiny_hf_model, write_random_text

    path = tmp_path / "llama"
    tiny_hf_model("llama", intermediate_size=64).save_pretrained(path)
    save_tiny_tokenizer(path)
    text = write_random_text(tmp_path / "calib.txt", 2000)
    code = convert_main(["--model", str(path), "--config", "S1A2E8", "--k-act", "4", "--data-path", str(text),
                         "--calib-samples", "2", "--seqlen", "32", "--calib-bos", "--out", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --calib-bos:") and "plain" in err[-1]
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()

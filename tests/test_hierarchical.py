"""Hierarchical CMoE on tiny random Qwen3-MoE and Mixtral checkpoints: parity with every
sub-expert active, the flattened dispatch against a per-expert loop, FLOPs, balancing,
resume, 8 devices, the CLI and LoRA fine-tuning of the result."""
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

from cmoe_jax.methods.cmoe import MoEPlan
from cmoe_jax.convert import ConvertConfig
from cmoe_jax.convert.cli import main as convert_main
from cmoe_jax.methods.hierarchical.convert import convert_moe_model
from cmoe_jax.loading import load_model
from cmoe_jax.moe.hierarchical import HierMoEFFN, flops_per_token

from conftest import xla_flags

ROOT = Path(__file__).resolve().parents[1]


def _calib(n=4, t=32, vocab=96, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=(n, t)).astype(np.int32)


@pytest.fixture(params=["qwen3_moe", "qwen3_moe_norm", "mixtral"])
def moe_source(request, save_tiny):
    kw = {"intermediate_size": 32} if request.param == "mixtral" else {}
    hf, path = save_tiny(request.param, **kw)
    return hf, load_model(str(path), progress=False).model


def _hf_logits(hf, tokens):
    import torch

    with torch.no_grad():
        return hf(torch.as_tensor(np.array(tokens), dtype=torch.long)).logits.numpy()


def test_every_sub_expert_active_equals_the_source(moe_source):
    hf, model = moe_source
    d_e = next(s for s in model.config.moe_layers if s is not None).expert_width
    plan = MoEPlan(1, 3, 4)  # all N'_r = 3 routed sub-experts active
    hier, records = convert_moe_model(model, _calib(), ConvertConfig(plan=plan, k_act=4, router_neurons=2),
                                       progress=False)
    tokens = jnp.asarray(_calib(2, 24, seed=5))
    np.testing.assert_allclose(np.asarray(hier(tokens)), _hf_logits(hf, tokens), atol=1e-4)
    for r, spec in zip(records, hier.config.moe_layers):
        if spec is None:
            continue
        assert spec.sub_experts == 4 and spec.expert_width == d_e // 4
        for e in r.experts:  # each expert's carving is a partition of its neurons
            ids = np.concatenate([e.carving.shared_idx, e.carving.expert_idx.ravel()])
            assert sorted(ids.tolist()) == list(range(d_e))


def _loop_reference(layer: HierMoEFFN, x):
    """Eq. 10 token by token, expert by expert (numpy), from the layer's own weights."""
    x = np.asarray(x, np.float64)
    ids, w = (np.asarray(a) for a in layer.top_route(jnp.asarray(x, jnp.float32)))
    p = {k: np.asarray(getattr(layer, k)[...], np.float64)
         for k in ("expert_gate", "expert_up", "expert_down", "sub_gate", "sub_up", "u", "router_bias")}
    n_sub, n_s, r = layer.sub_experts, layer.sub_shared, layer.spec.sub_router_neurons
    silu = lambda a: a / (1 + np.exp(-a))
    expert = lambda e, v: (silu(v @ p["expert_gate"][e]) * (v @ p["expert_up"][e])) @ p["expert_down"][e]
    out = np.zeros_like(x)
    for t, v in enumerate(x):
        for i, wi in zip(ids[t], w[t]):
            s = np.abs(silu(v @ p["sub_gate"][i]) * (v @ p["sub_up"][i])).reshape(-1, r).sum(-1)
            sp = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            chosen = np.argsort(-(sp + p["router_bias"][i]), kind="stable")[:layer.sub_top_k]
            y = sum(expert(i * n_sub + j, v) for j in range(n_s))
            y = y + sum((1 + sp[j] * p["u"][i, j]) * expert(i * n_sub + n_s + j, v) for j in chosen)
            out[t] += wi * y
    return out


@pytest.mark.parametrize("router", ["linear", "cmoe"])
def test_flattened_dispatch_equals_per_expert_loop(router):
    layer = HierMoEFFN(d_model=16, expert_width=4, num_experts=4, top_k=2, sub_experts=4, sub_shared=1, sub_top_k=2, sub_router_neurons=2,
                       router=router, activation="silu", rngs=nnx.Rngs(3))
    layer.u[...] = jax.random.normal(jax.random.key(1), layer.u[...].shape)
    layer.router_bias[...] = 0.01 * jax.random.normal(jax.random.key(2), layer.router_bias[...].shape)
    x = jax.random.normal(jax.random.key(0), (24, 16))
    np.testing.assert_allclose(np.asarray(layer(x)), _loop_reference(layer, x), atol=1e-5)


def test_flops_fall_by_the_predicted_fraction(moe_source):
    _, model = moe_source
    plan = MoEPlan(1, 1, 4)
    hier, _ = convert_moe_model(model, _calib(), ConvertConfig(plan=plan, k_act=4, router_neurons=2),
                                progress=False)
    d = model.config.hidden_size
    src = next(s for s in model.config.moe_layers if s is not None)
    spec = next(s for s in hier.config.moe_layers if s is not None)
    before, after = flops_per_token(d, src), flops_per_token(d, spec)
    # predicted: k (N'_s + N'_k) / N' of the expert FLOPs, plus k sub-routers of N'_r * r neurons
    k, d_e, n_r = src.top_k, src.expert_width, plan.routed
    assert after["experts"] == before["experts"] * (plan.shared + plan.active) // plan.total
    assert after["sub_router"] == k * 2 * 2 * d * n_r * 2
    # counted: the rows the one dispatch runs per token, and the sub-router columns it scores
    x = jax.random.normal(jax.random.key(0), (10, d))
    layer = next(l.mlp for l in hier.layers if isinstance(l.mlp, HierMoEFFN))
    ids, _ = layer.route(x)
    rows_per_token = ids.shape[1]
    assert rows_per_token * 3 * 2 * d * spec.expert_width == after["experts"]
    assert layer.sub_gate[...].shape[2] * 2 * 2 * d * k == after["sub_router"]


# ---- the job: CLI, manifest, resume, bad input, 8 devices, eval and LoRA -------------------

@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from conftest import save_tiny_tokenizer, tiny_hf_model, write_random_text

    root = tmp_path_factory.mktemp("hier")
    tiny_hf_model("qwen3_moe").save_pretrained(root / "moe")
    save_tiny_tokenizer(root / "moe")
    write_random_text(root / "calib.txt", 4000)
    return root


def _cli(root, out, *extra):
    return ["--model", str(root / "moe"), "--calib", "wikitext2", "--data-path", str(root / "calib.txt"),
            "--calib-samples", "2", "--seqlen", "32", "--k-act", "4", "--router-neurons", "2",
            "--out", str(out), *extra]


def test_cli_carves_an_moe_source_and_eval_and_train_load_it(moe_dir, tmp_path):
    from cmoe_jax.train import LoRAConfig, OptimConfig, TrainSettings, finetune

    out = tmp_path / "hier"
    assert convert_main(_cli(moe_dir, out, "--config", "S1A1E4", "--report")) == 0
    manifest = json.loads((out / "cmoe_manifest.json").read_text())
    assert manifest["method"] == "cmoe_hierarchical" and manifest["config"] == "S1A1E4"
    assert manifest["plan"]["top_level"] == {"experts": 4, "active": 2, "expert_width": 16,
                                             "router": "linear", "host_shared_width": 0}
    assert manifest["plan"]["sub_level"]["expert_width"] == 4
    experts = manifest["layers"][0]["experts"]
    assert len(experts) == 4 and len(experts[0]["routed"]) == 3 and len(experts[0]["shared"]) == 4
    assert sum(e["tokens"] for e in experts) == 2 * 2 * 32  # every token reaches k = 2 experts
    assert (out / "report" / "sub_expert_load.png").exists()
    lm = load_model(str(out), progress=False)
    assert isinstance(lm.model.layers[0].mlp, HierMoEFFN)
    from cmoe_jax.eval.cli import main as eval_main
    assert eval_main(["--model", str(out), "--dataset", "wikitext2", "--data-path",
                      str(moe_dir / "calib.txt"), "--seqlen", "32", "--max-windows", "2",
                      "--json", str(tmp_path / "ppl.json")]) == 0
    assert np.isfinite(json.loads((tmp_path / "ppl.json").read_text())["ppl"])
    job = TrainSettings(data_path=str(moe_dir / "calib.txt"), samples=8, seqlen=32, batch_size=2,
                        lora=LoRAConfig(rank=4), optim=OptimConfig(lr=1e-2, router_lr=1e-1, bias_speed=1e-2),
                        epochs=2)
    summary = finetune(str(out), job, out=tmp_path / "ft", progress=False)
    ft = load_model(str(tmp_path / "ft"), progress=False).model
    mlp = ft.layers[0].mlp
    assert np.abs(np.asarray(mlp.u[...])).max() > 0  # the sub-routers' gate scales trained
    assert np.abs(np.asarray(mlp.router_bias[...])).max() > 0  # and balanced
    assert summary is not None


@pytest.mark.parametrize("config, message", [("S1A1E5", "divide"), ("S1A4E4", "active"),
                                             ("S4A1E4", "shared")])
def test_cli_rejects_sub_plans_that_do_not_fit_the_experts(moe_dir, tmp_path, capsys, config, message):
    out = tmp_path / "out"
    assert convert_main(_cli(moe_dir, out, "--config", config)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "d_e=16" in err, err
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_interrupted_hierarchical_conversion_resumes_identically(moe_dir, tmp_path):
    from cmoe_jax.convert import Calibration, ConvertSettings, convert

    job = ConvertSettings(ConvertConfig(plan=MoEPlan.parse("S1A1E4"), k_act=4, router_neurons=2),
                     Calibration(data_path=str(moe_dir / "calib.txt"), samples=2, seqlen=32))
    convert(str(moe_dir / "moe"), job, out=tmp_path / "full", progress=False)
    out = tmp_path / "resumed"
    r = convert(str(moe_dir / "moe"), job, out=out, stop_after_layers=1, progress=False)
    assert r["out"] is None and not out.exists()
    convert(str(moe_dir / "moe"), job, out=out, resume=True, progress=False)
    a = json.loads((tmp_path / "full" / "cmoe_manifest.json").read_text())
    b = json.loads((out / "cmoe_manifest.json").read_text())
    assert [l["experts"] for l in a["layers"]] == [l["experts"] for l in b["layers"]]
    ma, mb = (load_model(str(p), progress=False).model for p in (tmp_path / "full", out))
    for (p, x), (_, y) in zip(nnx.to_flat_state(nnx.state(ma)), nnx.to_flat_state(nnx.state(mb))):
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()), err_msg=str(p))


_MULTI_DEVICE_SCRIPT = """
import sys; sys.path.insert(0, {root!r})
import jax, numpy as np
from cmoe_jax.methods.cmoe import MoEPlan
from cmoe_jax.convert import ConvertConfig
from cmoe_jax.methods.hierarchical.convert import convert_moe_model
from cmoe_jax.loading import load_model
model = load_model({path!r}, progress=False).model
calib = np.random.default_rng(0).integers(0, 96, size=(8, 32)).astype(np.int32)
cc = ConvertConfig(plan=MoEPlan.parse("S1A1E4"), k_act=4, router_neurons=2)
hier, recs = convert_moe_model(model, calib, cc, progress=False)
tokens = np.random.default_rng(1).integers(0, 96, size=(2, 16)).astype(np.int32)
np.savez({out!r}, logits=np.asarray(hier(tokens)), devices=len(jax.devices()),
         routed=np.stack([[e.carving.expert_idx for e in r.experts] for r in recs]))
"""


def test_eight_device_conversion_equals_one_device(moe_dir, tmp_path):
    results = {}
    for n in (1, 8):
        out = tmp_path / f"r{n}.npz"
        env = dict(os.environ, XLA_FLAGS=xla_flags(n), JAX_PLATFORMS="cpu")
        script = _MULTI_DEVICE_SCRIPT.format(root=str(ROOT), path=str(moe_dir / "moe"), out=str(out))
        subprocess.run([sys.executable, "-c", script], check=True, env=env)
        results[n] = np.load(out)
    assert int(results[8]["devices"]) == 8 and int(results[1]["devices"]) == 1
    np.testing.assert_array_equal(results[1]["routed"], results[8]["routed"])
    np.testing.assert_allclose(results[1]["logits"], results[8]["logits"], atol=1e-5)


def test_converted_cmoe_source_carves_through_the_cli_with_parity(tiny_checkpoint, tmp_path):
    """A converted cmoe_jax MoE (cmoe top-level router, host shared MLP) as the source: with
    every sub-expert active the hierarchical model gives the source's logits."""
    _, path, text = tiny_checkpoint
    common = ["--calib", "wikitext2", "--data-path", str(text), "--calib-samples", "2",
              "--seqlen", "32", "--k-act", "4", "--router-neurons", "2"]
    assert convert_main(["--model", str(path), "--config", "S1A2E4", "--out", str(tmp_path / "moe"),
                         *common]) == 0
    assert convert_main(["--model", str(tmp_path / "moe"), "--config", "S0A4E4",
                         "--out", str(tmp_path / "hier"), *common]) == 0
    manifest = json.loads((tmp_path / "hier" / "cmoe_manifest.json").read_text())
    assert manifest["plan"]["top_level"]["router"] == "cmoe"
    assert manifest["plan"]["top_level"]["host_shared_width"] == 16
    src = load_model(str(tmp_path / "moe"), progress=False).model
    hier = load_model(str(tmp_path / "hier"), progress=False).model
    tokens = jnp.asarray(_calib(2, 24, seed=5))
    np.testing.assert_allclose(np.asarray(hier(tokens)), np.asarray(src(tokens)), atol=1e-4)


def test_random_baseline_is_a_partition_too(moe_source):
    from cmoe_jax.methods.hierarchical.convert import random_hierarchical

    hf, model = moe_source
    hier = random_hierarchical(model, ConvertConfig(plan=MoEPlan(1, 3, 4), router_neurons=2))
    tokens = jnp.asarray(_calib(2, 24, seed=5))
    np.testing.assert_allclose(np.asarray(hier(tokens)), _hf_logits(hf, tokens), atol=1e-4)
    sparse = random_hierarchical(model, ConvertConfig(plan=MoEPlan(1, 1, 4), router_neurons=2))
    assert np.abs(np.asarray(sparse(tokens)) - _hf_logits(hf, tokens)).max() > 1e-3

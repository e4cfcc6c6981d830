"""ConMoE and its baselines on a hierarchical CMoE model (a tiny random Qwen3-MoE carved into
S1A1E4 sub-experts): the unit is a top-level expert's family (sub-experts + sub-router). The
prototype runtime against the copied checkpoint, the family statistics against a numpy loop,
aligned M-SMoE merging permuted families back, and the CLI / LoRA on the result."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cmoe_jax.methods.cmoe import MoEPlan
from cmoe_jax.methods.conmoe import apply_plans, baseline_plans, collect_stats, conmoe_plans, materialize, routed_bytes
from cmoe_jax.convert import ConvertConfig
from cmoe_jax.methods.hierarchical.convert import convert_moe_model
from cmoe_jax.loading import load_model

CALIB = np.random.default_rng(0).integers(0, 96, (2, 32)).astype(np.int32)
TOKENS = jnp.asarray(np.random.default_rng(1).integers(0, 96, (2, 16)).astype(np.int32))


def _randomise_sub_routers(model, seed=0):
    """Non-zero gate scales u and balancing biases, so copying them with a family matters."""
    rng = np.random.default_rng(seed)
    for i, layer in enumerate(model.unstacked().layers):  # editable copies, written back below
        mlp = layer.mlp
        mlp.u[...] = jnp.asarray(rng.normal(size=mlp.u[...].shape), mlp.u[...].dtype)
        mlp.router_bias[...] = jnp.asarray(0.05 * rng.normal(size=mlp.router_bias[...].shape), jnp.float32)
        model.set_layer(i, layer)


@pytest.fixture(scope="module")
def hier(tmp_path_factory):
    from tests.conftest import tiny_hf_model

    path = tmp_path_factory.mktemp("qwen3_moe")
    tiny_hf_model("qwen3_moe", num_hidden_layers=4).save_pretrained(path)
    source = load_model(str(path), progress=False).model
    model, _ = convert_moe_model(source, np.concatenate([CALIB, CALIB[:, ::-1]]),
                                 ConvertConfig(plan=MoEPlan(1, 1, 4), k_act=4, router_neurons=2),
                                 progress=False)
    _randomise_sub_routers(model)
    return model, collect_stats(model, CALIB, progress=False)


@pytest.mark.parametrize("method,scope,selection", [
    ("conmoe", 1, "adaptive"), ("conmoe", 2, "adaptive"), ("conmoe", 4, "fixed"),
    ("msmoe", 1, "adaptive"), ("hcsmoe", 1, "adaptive")])
def test_family_runtime_equals_copied_checkpoint(hier, method, scope, selection):
    model, stats = hier
    plans = (conmoe_plans(model, stats, 0.5, scope, selection)[0] if method == "conmoe"
             else baseline_plans(method, stats, 0.5, model))
    runtime, copied = apply_plans(model, plans), materialize(model, plans)
    np.testing.assert_allclose(np.asarray(runtime(TOKENS)), np.asarray(copied(TOKENS)), atol=1e-6)
    k = sum(p.num_prototypes for p in plans)
    assert k == 8  # half of the 4 layers x 4 families
    assert routed_bytes(runtime) * 16 == routed_bytes(model) * k
    mlp = runtime.layers[1].mlp
    owner = next(p for p in plans if 1 in p.layers)  # the layer stores its scope's families
    assert mlp.expert_gate[...].shape[0] == 4 * owner.num_prototypes == 4 * mlp.sub_gate[...].shape[0]
    if scope > 1:  # the scope shares the families' experts and sub-routers, not u or the bias
        first = runtime.layers[0].mlp
        assert mlp.expert_gate is first.expert_gate and mlp.sub_gate is first.sub_gate
        assert mlp.u is not first.u and mlp.router_bias is not first.router_bias


def test_keeping_every_family_is_the_identical_model(hier):
    model, stats = hier
    plans, _ = conmoe_plans(model, stats, 0.0, 2)
    runtime = apply_plans(model, plans)  # scope-2 tables shared by two layers: run unrolled
    np.testing.assert_array_equal(np.asarray(runtime(TOKENS)), np.asarray(model.unstacked()(TOKENS)))


def test_pruned_families_are_never_chosen(hier):
    """Frequency pruning: the kept families' slots only, each its own family's weights."""
    model, stats = hier
    plan = baseline_plans("frequency", stats, 0.5, model)[2]
    kept = np.flatnonzero(plan.slot_maps[2] >= 0)
    assert kept.tolist() == sorted(np.argsort(-stats[2].freq, kind="stable")[:2].tolist())
    runtime = apply_plans(model, [plan])
    mlp, src = runtime.layers[2].mlp, model.layers[2].mlp
    x = jax.random.normal(jax.random.key(0), (64, 32))
    ids, _ = mlp.top_route(x, keep=mlp.slot_map[...] >= 0)
    assert set(np.asarray(ids).ravel().tolist()) <= set(kept.tolist())
    rows = np.concatenate([np.arange(4 * e, 4 * e + 4) for e in kept])
    np.testing.assert_array_equal(np.asarray(mlp.expert_down[...]), np.asarray(src.expert_down[...])[rows])
    np.testing.assert_array_equal(np.asarray(mlp.u[...]), np.asarray(src.u[...])[kept])


def _family_outputs(mlp, x):
    """numpy `[T, N, d]`: family i's output E_i^s(x) + sum_j g'_ij E_ij^r(x) on every token."""
    p = {k: np.asarray(getattr(mlp, k)[...], np.float64)
         for k in ("expert_gate", "expert_up", "expert_down", "sub_gate", "sub_up", "u", "router_bias")}
    silu = lambda a: a / (1 + np.exp(-a))
    expert = lambda e, v: (silu(v @ p["expert_gate"][e]) * (v @ p["expert_up"][e])) @ p["expert_down"][e]
    n_sub, n_s, r = mlp.sub_experts, mlp.sub_shared, mlp.spec.sub_router_neurons
    out = np.zeros((len(x), mlp.top_experts, x.shape[1]))
    for t, v in enumerate(x):
        for i in range(mlp.top_experts):
            s = np.abs(silu(v @ p["sub_gate"][i]) * (v @ p["sub_up"][i])).reshape(-1, r).sum(-1)
            sp = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            chosen = np.argsort(-(sp + p["router_bias"][i]), kind="stable")[:mlp.sub_top_k]
            y = sum(expert(i * n_sub + j, v) for j in range(n_s))
            out[t, i] = y + sum((1 + sp[j] * p["u"][i, j]) * expert(i * n_sub + n_s + j, v) for j in chosen)
    return out


def test_family_statistics_against_numpy(hier):
    """freq, a_e, mean outputs and top-level logit Gram of layer 0 from a per-token loop."""
    from tests.test_compress import assert_stats_match

    assert_stats_match(*hier, _family_outputs)


def test_msmoe_merges_permuted_families_back(hier):
    """Families that are copies of family 0 with each sub-expert's neurons permuted compute
    family 0's function; the per-sub-expert alignment merges them back exactly."""
    model, stats = hier
    copies = nnx.clone(model).unstacked()  # one module per layer: layer 1 is changed below
    mlp = copies.layers[1].mlp
    rng = np.random.default_rng(4)
    gate, up, down = (np.array(w[...]) for w in (mlp.expert_gate, mlp.expert_up, mlp.expert_down))
    for name in ("sub_gate", "sub_up", "u", "router_bias"):
        arr = np.array(getattr(mlp, name)[...])
        arr[1:] = arr[0]
        getattr(mlp, name)[...] = jnp.asarray(arr)
    for e in range(1, 4):
        for j in range(4):
            perm = rng.permutation(gate.shape[-1])
            row, src = 4 * e + j, j
            gate[row], up[row], down[row] = gate[src][:, perm], up[src][:, perm], down[src][perm]
    mlp.expert_gate[...], mlp.expert_up[...], mlp.expert_down[...] = gate, up, down
    plan = baseline_plans("msmoe", stats, 0.5, copies)[1]
    assert all(np.asarray(p).shape == (4, gate.shape[-1]) for p in plan.perms.values())
    merged = apply_plans(copies, [plan])
    np.testing.assert_allclose(np.asarray(merged(TOKENS)), np.asarray(copies(TOKENS)), atol=1e-6)


def test_cli_compresses_a_hierarchical_model_and_lora_trains_it(tmp_path):
    """convert (hierarchical) -> compress -> load: the saved model equals the in-memory
    runtime; LoRA gradients reach the stored families' adapters."""
    from tests.conftest import save_tiny_tokenizer, tiny_hf_model, write_random_text
    from cmoe_jax.compress.cli import main as compress_main
    from cmoe_jax.convert.cli import main as convert_main
    from cmoe_jax.train import LoRAConfig, init_adapters, lora_loss, router_params

    tiny_hf_model("qwen3_moe", num_hidden_layers=4).save_pretrained(tmp_path / "moe")
    save_tiny_tokenizer(tmp_path / "moe")
    text = write_random_text(tmp_path / "calib.txt", 3000)
    data = ["--calib", "wikitext2", "--data-path", str(text), "--calib-samples", "2", "--seqlen", "32"]
    assert convert_main(["--model", str(tmp_path / "moe"), "--config", "S1A1E4", "--k-act", "4",
                         "--router-neurons", "2", "--out", str(tmp_path / "hier"), *data]) == 0
    assert compress_main(["--model", str(tmp_path / "hier"), "--method", "conmoe", "--ratio", "0.5",
                          "--scope", "2", "--report", "--out", str(tmp_path / "c"), *data]) == 0
    manifest = json.loads((tmp_path / "c" / "cmoe_manifest.json").read_text())
    assert manifest["compression"]["prototypes"] == 8
    assert manifest["compression"]["routed_bytes_after"] * 2 == manifest["compression"]["routed_bytes_before"]
    restored = load_model(str(tmp_path / "c"), progress=False).model
    assert restored.config.moe_layers[1].sub_experts == 4
    assert restored.layers[1].mlp.sub_gate is restored.layers[0].mlp.sub_gate
    from cmoe_jax.methods.conmoe import ScopePlan

    plans = [ScopePlan(s["layers"], np.asarray(s["mix"]),
                       {int(l): np.asarray(m, np.int32) for l, m in s["slot_maps"].items()})
             for s in manifest["scopes"]]
    source = load_model(str(tmp_path / "hier"), progress=False).model
    np.testing.assert_allclose(np.asarray(restored(TOKENS)), np.asarray(apply_plans(source, plans)(TOKENS)),
                               atol=1e-6)
    cfg = LoRAConfig(rank=2, alpha=4.0, dropout=0.0, targets=("gate_proj", "up_proj", "down_proj"))
    adapters = init_adapters(restored, cfg, jax.random.key(0))
    u, b = router_params(restored)
    loss, grads = jax.value_and_grad(
        lambda ad: lora_loss(restored, cfg.applied(ad, u, b), TOKENS)[0])(adapters)
    assert np.isfinite(float(loss))
    assert float(jnp.abs(grads["layers"]["1"]["mlp"]["expert_gate"]["b"]).sum()) > 0
    # the training job itself on a compressed model (layer-local: adapters merge into the table)
    from cmoe_jax.train import LoRAConfig, OptimConfig, TrainSettings, finetune

    assert compress_main(["--model", str(tmp_path / "hier"), "--method", "reap", "--ratio", "0.5",
                          "--out", str(tmp_path / "r"), *data]) == 0
    # 3 steps: the balancing bias moves by +-bias_speed a step, so an even number of steps can
    # bring an oscillating sub-router back to exactly 0
    finetune(str(tmp_path / "r"), TrainSettings(data_path=str(text), samples=6, seqlen=32, batch_size=2,
                                           lora=LoRAConfig(rank=4),
                                           optim=OptimConfig(lr=1e-2, router_lr=1e-1, bias_speed=1e-2),
                                           epochs=1),
             out=tmp_path / "ft", progress=False)
    ft = load_model(str(tmp_path / "ft"), progress=False).model
    assert ft.config.moe_layers[0].num_prototypes == 2
    assert np.abs(np.asarray(ft.layers[0].mlp.router_bias[...])).max() > 0  # balanced while training
    assert np.isfinite(np.asarray(ft(TOKENS))).all()

"""`python -m cmoe_jax.compress` end to end on a tiny random Mixtral: rho = 0 keeps the
model, saved models restore to the in-memory runtime, resume, bad input, LoRA on the result."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cmoe_jax.compress import Calibration, CompressConfig, CompressSettings, compress
from cmoe_jax.compress.cli import main
from tests.conftest import save_tiny_tokenizer, write_random_text
from cmoe_jax.loading import load_model


@pytest.fixture
def mixtral(save_tiny, tmp_path):
    _, path = save_tiny("mixtral", num_hidden_layers=4)
    save_tiny_tokenizer(path)
    return path, write_random_text(tmp_path / "calib.txt", 3000)


def _args(path, text, out, *extra):
    return ["--model", str(path), "--data-path", str(text), "--calib-samples", "2", "--seqlen", "32",
            "--out", str(out), *extra]


def _calibration(text):
    return Calibration(data_path=str(text), samples=2, seqlen=32)


def _flat(model):
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def test_ratio_zero_returns_the_identical_model(mixtral, tmp_path):
    path, text = mixtral
    assert main(_args(path, text, tmp_path / "out", "--method", "conmoe", "--ratio", "0")) == 0
    before, after = _flat(load_model(str(path)).model), _flat(load_model(str(tmp_path / "out")).model)
    assert before.keys() == after.keys()
    for p in before:
        np.testing.assert_array_equal(before[p], after[p])


def test_saved_model_restores_and_reports(mixtral, tmp_path):
    path, text = mixtral
    out = tmp_path / "c"
    assert main(_args(path, text, out, "--method", "conmoe", "--ratio", "0.5", "--scope", "2",
                      "--report")) == 0
    manifest = json.loads((out / "cmoe_manifest.json").read_text())
    c = manifest["compression"]
    assert c["prototypes"] == 8 and c["routed_bytes_after"] * 2 == c["routed_bytes_before"]
    assert len(manifest["scopes"]) == 2 and (out / "report" / "slot_map.png").exists()
    assert not (tmp_path / "c.partial").exists()
    restored = load_model(str(out)).model
    assert restored.layers[1].mlp.expert_gate is restored.layers[0].mlp.expert_gate
    tokens = jnp.asarray(np.arange(16, dtype=np.int32)[None] % 90)
    assert np.isfinite(np.asarray(restored(tokens))).all()
    # the same run in memory gives the same logits
    from cmoe_jax.methods.conmoe import ScopePlan, apply_plans

    plans = [ScopePlan(s["layers"], np.asarray(s["mix"]), {int(k): np.asarray(v, np.int32)
                                                          for k, v in s["slot_maps"].items()})
             for s in manifest["scopes"]]
    np.testing.assert_allclose(np.asarray(apply_plans(load_model(str(path)).model, plans)(tokens)),
                               np.asarray(restored(tokens)), atol=1e-5)


def test_gate_rule_and_output_distance_are_saved_and_used(mixtral, tmp_path):
    """`--duplicate-gates max --distance outputs`: the manifest records both, the restored
    model carries the rule in its config, and its logits equal the in-memory runtime's with
    that rule (and differ from the summed gates' where slots share a prototype)."""
    from cmoe_jax.methods.conmoe import ScopePlan, apply_plans

    path, text = mixtral
    out = tmp_path / "c"
    assert main(_args(path, text, out, "--method", "conmoe", "--ratio", "0.5", "--distance", "outputs",
                      "--duplicate-gates", "max")) == 0
    manifest = json.loads((out / "cmoe_manifest.json").read_text())
    assert manifest["compression"]["distance"] == "outputs"
    assert manifest["compression"]["duplicate_gates"] == "max"
    restored = load_model(str(out)).model
    assert {s.duplicate_gates for s in restored.config.moe_layers if s} == {"max"}
    plans = [ScopePlan(s["layers"], np.asarray(s["mix"]), {int(k): np.asarray(v, np.int32)
                                                          for k, v in s["slot_maps"].items()})
             for s in manifest["scopes"]]
    source = load_model(str(path)).model
    tokens = jnp.asarray(np.arange(64, dtype=np.int32).reshape(2, 32) % 90)
    np.testing.assert_allclose(np.asarray(apply_plans(source, plans, "max")(tokens)),
                               np.asarray(restored(tokens)), atol=1e-5)
    assert not np.allclose(np.asarray(apply_plans(source, plans, "sum")(tokens)),
                           np.asarray(restored(tokens)), atol=1e-5)


def test_resume_equals_uninterrupted(mixtral, tmp_path):
    path, text = mixtral
    job = CompressSettings(CompressConfig(method="hcsmoe", ratio=0.5), _calibration(text))
    kw = dict(progress=False)
    assert compress(str(path), job, out=tmp_path / "r", stop_after_layers=2, **kw)["out"] is None
    assert len(list((tmp_path / "r.partial" / "layers").glob("*.npz"))) == 2
    resumed = compress(str(path), job, out=tmp_path / "r", resume=True, **kw)
    fresh = compress(str(path), job, out=tmp_path / "f", **kw)
    assert resumed["scopes"] == fresh["scopes"]


@pytest.mark.parametrize("extra,message", [
    (["--method", "conmoe", "--ratio", "1.0"], "--ratio"),
    (["--method", "reap", "--ratio", "0.5", "--scope", "2"], "--scope"),
    (["--method", "conmoe", "--ratio", "0.5", "--scope", "0"], "--scope"),
    (["--method", "frequency", "--ratio", "0.5", "--distance", "outputs"], "--distance"),
    (["--method", "conmoe", "--ratio", "0.5", "--duplicate-gates", "mean"], "--duplicate-gates"),
])
def test_bad_input_is_one_error_line(mixtral, tmp_path, capsys, extra, message):
    path, text = mixtral
    assert main(_args(path, text, tmp_path / "o", *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0]
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_dense_model_is_refused(save_tiny, tmp_path, capsys):
    _, path = save_tiny("llama")
    save_tiny_tokenizer(path)
    text = write_random_text(tmp_path / "t.txt", 500)
    assert main(_args(path, text, tmp_path / "o", "--method", "conmoe", "--ratio", "0.5")) == 2
    assert "no MoE layers" in capsys.readouterr().err


def test_lora_trains_on_the_prototype_runtime(mixtral, tmp_path):
    """LoRA gradients flow through a scope-shared prototype table (adapters per layer)."""
    from cmoe_jax.train import LoRAConfig, init_adapters, lora_loss, router_params

    path, text = mixtral
    compress(str(path), CompressSettings(CompressConfig(method="conmoe", ratio=0.5, scope=2), _calibration(text)),
             out=tmp_path / "c", progress=False)
    model = load_model(str(tmp_path / "c")).model
    cfg = LoRAConfig(rank=2, alpha=4.0, dropout=0.0, targets=("gate_proj", "up_proj", "down_proj"))
    adapters = init_adapters(model, cfg, jax.random.key(0))
    assert "expert_gate" in adapters["layers"]["1"]["mlp"]
    u, b = router_params(model)
    tokens = jnp.asarray(np.arange(32, dtype=np.int32).reshape(2, 16) % 90)
    loss, grads = jax.value_and_grad(lambda ad: lora_loss(model, cfg.applied(ad, u, b), tokens)[0])(adapters)
    assert np.isfinite(float(loss))
    gb = grads["layers"]["1"]["mlp"]["expert_gate"]["b"]
    assert float(jnp.abs(gb).sum()) > 0


def test_train_job_runs_on_a_compressed_model(mixtral, tmp_path):
    """`python -m cmoe_jax.train`'s job on a layer-local ConMoE model: the adapters merge into
    the prototype table, and the result loads with its slot maps."""
    from cmoe_jax.train import LoRAConfig, OptimConfig, TrainSettings, finetune

    path, text = mixtral
    compress(str(path), CompressSettings(CompressConfig(method="conmoe", ratio=0.5), _calibration(text)),
             out=tmp_path / "c", progress=False)
    before = load_model(str(tmp_path / "c")).model
    finetune(str(tmp_path / "c"), TrainSettings(data_path=str(text), samples=8, seqlen=32, batch_size=2,
                                           lora=LoRAConfig(rank=4), optim=OptimConfig(lr=1e-2), epochs=1),
             out=tmp_path / "ft", progress=False)
    after = load_model(str(tmp_path / "ft")).model
    assert after.config.moe_layers[0].num_prototypes == before.config.moe_layers[0].num_prototypes == 2
    np.testing.assert_array_equal(np.asarray(after.layers[0].mlp.slot_map[...]),
                                  np.asarray(before.layers[0].mlp.slot_map[...]))
    moved = np.abs(np.asarray(after.layers[0].mlp.expert_gate[...]) -
                   np.asarray(before.layers[0].mlp.expert_gate[...])).max()
    assert moved > 0  # the trained adapters were merged into the table


def test_train_refuses_a_table_shared_across_layers(mixtral, tmp_path, capsys):
    """Adapters of the routed experts cannot be merged into a table several layers share:
    one error line before any training, nothing written."""
    from cmoe_jax.train.cli import main as train_main

    path, text = mixtral
    compress(str(path), CompressSettings(CompressConfig(method="conmoe", ratio=0.5, scope=2), _calibration(text)),
             out=tmp_path / "c", progress=False)
    args = ["--model", str(tmp_path / "c"), "--dataset", "wikitext2", "--data-path", str(text),
            "--samples", "8", "--seqlen", "32", "--batch-size", "2", "--out", str(tmp_path / "ft")]
    assert train_main(args) == 2
    assert "--scope 1" in capsys.readouterr().err
    assert not (tmp_path / "ft").exists() and not (tmp_path / "ft.partial").exists()


def test_identical_runs_record_identical_figures(mixtral, tmp_path):
    """The manifest's figures are the same on a rerun (Orbax's file sizes are not: OCDBT packs
    chunks by the order its writes finish), and the state's bytes are those of the arrays
    the restored model holds."""
    path, text = mixtral
    figures = []
    for out in (tmp_path / "a", tmp_path / "b"):
        assert main(_args(path, text, out, "--method", "conmoe", "--ratio", "0.5", "--no-progress")) == 0
        figures.append(json.loads((out / "cmoe_manifest.json").read_text())["compression"])
    assert figures[0] == figures[1]
    restored = _flat(load_model(str(tmp_path / "a")).model)
    assert figures[0]["state_array_bytes"] == sum(a.nbytes for a in restored.values())

"""LoRA fine-tuning (`cmoe_jax.train`) on tiny random models: the adapted forward against a
dense recomputation, merging, sharding, exact resumption and bad input."""
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

from cmoe_jax.checkpoint import save_converted
from cmoe_jax.loading import load_model
from cmoe_jax.models import ModelConfig
from cmoe_jax.models.stack import LayerStack
from cmoe_jax.lora_variables import LoRA
from cmoe_jax.train import (AdapterSet, LoRAConfig, TrainSettings, adapted_weights, finetune, init_adapters, load_adapters,
                            lora_logits, lora_loss, merge_adapters, router_params, with_adapters)
from cmoe_jax.train.cli import main as train_main
from conftest import dense_and_converted, save_tiny_tokenizer, write_random_text, xla_flags

ROOT = Path(__file__).resolve().parents[1]
CFG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, activation="silu", max_position_embeddings=128)


@pytest.fixture(scope="module")
def models():
    """A tiny random dense Llama and its CMoE conversion (S2A2E8: shared MLP + 6 routed experts)."""
    return dense_and_converted(CFG, "S2A2E8")


@pytest.fixture(scope="module")
def model_dirs(models, tmp_path_factory):
    """Both models saved as converted-model directories with a tokenizer, plus a text file."""
    root = tmp_path_factory.mktemp("train")
    dense, moe = models
    for name, m in (("dense", dense), ("moe", moe)):
        save_converted(m, {"source_model": "tiny", "method": name}, root / name)
        save_tiny_tokenizer(root / name / "tokenizer")
    write_random_text(root / "text.txt", 3000)
    return root


def _tokens(b=2, t=16, seed=3):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 96, (b, t)), jnp.int32)


def _randomised(adapters, seed=5, std=0.05):
    leaves, treedef = jax.tree.flatten(adapters)
    key = jax.random.key(seed)
    return jax.tree.unflatten(treedef, [std * jax.random.normal(jax.random.fold_in(key, i), a.shape)
                                        for i, a in enumerate(leaves)])


def _trained_like(model, lora):
    """Non-zero adapters, non-zero router scales and biases (as after some training)."""
    adapters = _randomised(init_adapters(model, lora, jax.random.key(1)))
    us, bs = router_params(model)
    us = {k: jnp.linspace(-1.0, 1.0, v.shape[0]) for k, v in us.items()}
    bs = {k: 0.01 * jnp.arange(v.shape[0], dtype=jnp.float32) for k, v in bs.items()}
    return adapters, us, bs


def test_targets_cover_attention_shared_and_experts(models):
    _, moe = models
    names = {p[-1] for p, _ in adapted_weights(moe, LoRAConfig().targets)}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "shared_gate", "shared_up",
                     "shared_down", "expert_gate", "expert_up", "expert_down"}
    ad = init_adapters(moe, LoRAConfig(rank=4), jax.random.key(0))["layers"]["0"]["mlp"]
    assert ad["expert_up"]["a"].shape == (6, 32, 4) and ad["expert_up"]["b"].shape == (6, 4, 8)
    assert ad["expert_down"]["a"].shape == (6, 8, 4) and ad["expert_down"]["b"].shape == (6, 4, 32)
    assert not np.any(np.asarray(ad["expert_down"]["b"]))


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_zero_adapters_give_the_base_model(models, which):
    model = dict(zip(("dense", "moe"), models))[which]
    lora = LoRAConfig(rank=4, alpha=8)
    adapters = init_adapters(model, lora, jax.random.key(1))  # B = 0, A random
    us, bs = router_params(model)
    tokens = _tokens()
    got = lora_logits(model, lora.applied(adapters, us, bs), tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(model(tokens)), rtol=0, atol=1e-6)


def test_adapters_are_variables_of_the_model_split_by_type(models):
    _, moe = models
    lora = LoRAConfig(rank=4, alpha=8)
    adapters, us, bs = _trained_like(moe, lora)
    adapted = with_adapters(moe, adapters, lora.scale, us, bs)
    _, lora_state, frozen = nnx.split(adapted, LoRA, ...)
    got = {p for p, _ in nnx.to_flat_state(lora_state)}
    layer = lambda i: "stacked" if isinstance(moe.layers, LayerStack) else i  # stacked layers
    want = {(p[0], layer(p[1]), *p[2:-1], p[-1] + s) for p, _ in adapted_weights(moe, lora.targets)
            for s in ("_lora_a", "_lora_b")}
    assert got == want and not any(isinstance(v, LoRA) for _, v in nnx.to_flat_state(frozen))
    assert not any(isinstance(v, LoRA) for _, v in nnx.to_flat_state(nnx.state(moe)))  # base untouched
    # the model's own forward runs them: the same logits as the functional entry point
    tokens = _tokens()
    np.testing.assert_allclose(np.asarray(adapted(tokens)),
                               np.asarray(lora_logits(moe, lora.applied(adapters, us, bs), tokens)),
                               rtol=0, atol=0)


def test_dropout_follows_the_key_and_remat_changes_nothing(models):
    _, moe = models
    lora = LoRAConfig(rank=4, alpha=8, dropout=0.3)
    adapters, us, bs = _trained_like(moe, lora)
    tokens, key = _tokens(), jax.random.key(9)
    f = lambda remat, key=key: jax.jit(lambda ad, u: lora_loss(
        moe, lora.applied(ad, u, bs), tokens, key=key, remat=remat))(adapters, us)
    (l1, loads1), (l2, loads2) = f(True), f(False)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)
    assert abs(float(f(False, jax.random.key(10))[0]) - float(l1)) > 1e-5  # masks follow the key
    assert sorted(loads1) == sorted(loads2) == ["0", "1"]
    for k in loads1:
        np.testing.assert_array_equal(np.asarray(loads1[k]), np.asarray(loads2[k]))
        assert int(loads1[k].sum()) == tokens.size * moe.layers[0].mlp.top_k
    no_drop = lora_loss(moe, AdapterSet(adapters, us, bs, lora.scale), tokens)[0]
    assert abs(float(no_drop) - float(l1)) > 1e-4  # dropout is applied


def _reference_loss(model, adapters, us, bs, tokens, scale):
    """Independent reference: W + scale * A @ B written into a copy of the base model by hand,
    u and b set, the plain `Decoder` forward (one module per layer), log-softmax NLL in jnp."""
    graphdef, state = nnx.split(model.unstacked())
    values = {}
    for i, layer in adapters["layers"].items():
        for group, weights in layer.items():
            for name, ab in weights.items():
                if ab["a"].ndim == 3:
                    upd = jnp.einsum("edr,erm->edm", ab["a"], ab["b"])
                else:
                    upd = ab["a"] @ ab["b"]
                values[("layers", int(i), group, name)] = lambda w, upd=upd: w + scale * upd
    for i, u in us.items():
        values[("layers", int(i), "mlp", "u")] = lambda w, u=u: u
        values[("layers", int(i), "mlp", "router_bias")] = lambda w, b=bs[i]: b

    def replace(path, w):
        key = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        return values[key](w) if key in values else w

    m = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(replace, state))
    logits = m(tokens).astype(jnp.float32)[:, :-1]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_loss_and_gradients_match_dense_recomputation(models, which):
    model = dict(zip(("dense", "moe"), models))[which]
    lora = LoRAConfig(rank=4, alpha=8)
    adapters, us, bs = _trained_like(model, lora)
    tokens = _tokens(2, 24)

    def ours(ad, u):
        return lora_loss(model, lora.applied(ad, u, bs), tokens)[0]

    def ref(ad, u):
        return _reference_loss(model, ad, u, bs, tokens, lora.scale)

    l1, g1 = jax.jit(jax.value_and_grad(ours, argnums=(0, 1)))(adapters, us)
    l2, g2 = jax.jit(jax.value_and_grad(ref, argnums=(0, 1)))(adapters, us)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)
    leaves1, leaves2 = jax.tree.leaves(g1), jax.tree.leaves(g2)
    assert len(leaves1) == len(leaves2) > 0
    assert jax.tree.structure(g1) == jax.tree.structure(g2)
    for a, b in zip(leaves1, leaves2):
        scale = max(float(jnp.max(jnp.abs(b))), 1e-6)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5 * scale + 1e-7, rtol=1e-3)
    if which == "moe":  # the expert adapters and u do receive gradient
        assert float(jnp.max(jnp.abs(g1[0]["layers"]["1"]["mlp"]["expert_down"]["a"]))) > 0
        assert float(jnp.max(jnp.abs(g1[1]["0"]))) > 0


def test_merged_and_unmerged_give_the_same_logits(models):
    _, moe = models
    lora = LoRAConfig(rank=4, alpha=32)
    adapters, us, bs = _trained_like(moe, lora)
    tokens = _tokens(2, 20, seed=7)
    before = np.asarray(moe(tokens))
    merged = merge_adapters(moe, adapters, lora.scale, us, bs)
    want = np.asarray(lora_logits(moe, lora.applied(adapters, us, bs), tokens))
    np.testing.assert_allclose(np.asarray(merged(tokens)), want, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(moe(tokens)), before)  # the base is untouched
    assert np.max(np.abs(want - before)) > 1e-2  # the adapters do change the model


def test_the_flags_fill_the_sub_configs_and_their_defaults_are_the_clis():
    """`TrainSettings` holds its sub-configs whole; `from_flags` (the CLI, `split_options`)
    reads the flat flag names into them, and the CLI's defaults are the sub-configs' own."""
    from cmoe_jax.train import DistillConfig, OptimConfig, RecoverConfig, TrainError
    from cmoe_jax.train.cli import build_parser
    from cmoe_jax.train.settings import FLAGS

    s = TrainSettings.from_flags(samples=8, lora_rank=4, lora_alpha=16.0, dropout=0.1, targets="q_proj, up_proj",
                                 lr=1e-2, router_lr=0.0, bias_speed=0.5, distill=True, kd_temperature=2.0,
                                 kd_weight=0.5, kd_top_k=3, hidden_weight=0.1, recover="layerwise",
                                 recover_samples=4, recover_steps=5, recover_lr=0.1)
    assert s.samples == 8 and s.lora.parsed() == LoRAConfig(4, 16.0, 0.1, ("q_proj", "up_proj"))
    assert s.optim == OptimConfig(lr=1e-2, router_lr=0.0, bias_speed=0.5)
    assert s.distill == DistillConfig(2.0, 0.5, 3, 0.1) and s.recover == RecoverConfig(4, 5, 0.1)
    plain = TrainSettings.from_flags(distill=False, recover=None)
    assert plain == TrainSettings() and plain.distill is None and plain.recover is None
    args = build_parser().parse_args(["--model", "m", "--out", "o"])
    cli = TrainSettings.from_flags(**{flag: getattr(args, flag) for flag in FLAGS}, distill=True, recover="layerwise")
    assert cli.lora.parsed() == LoRAConfig() and cli.optim == OptimConfig()
    assert cli.distill == DistillConfig() and cli.recover == RecoverConfig()
    with pytest.raises(TrainError, match="from_flags"):
        TrainSettings(recover="layerwise")  # the flag's value, not a RecoverConfig
    with pytest.raises(TrainError, match="--recover must be"):
        TrainSettings.from_flags(recover="global")


def _run(model_dirs, out, **kw):
    args = dict(data_path=str(model_dirs / "text.txt"), samples=8, seqlen=32, batch_size=2,
                lora_rank=4, lr=1e-2, router_lr=1e-2, bias_speed=1e-2, epochs=2,
                save_every=2, progress=False)
    args.update(kw)
    job, options = TrainSettings.split_options(args)
    return finetune(str(model_dirs / "moe"), job, out=out, **options)


@pytest.fixture(scope="module")
def full_run(model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "run"
    return out, _run(model_dirs, out, dropout=0.1, max_steps=6)


def _same_run(a_dir, b_dir):
    log_a = json.loads((a_dir / "train_log.json").read_text())["steps"]
    log_b = json.loads((b_dir / "train_log.json").read_text())["steps"]
    assert len(log_a) == len(log_b) == 6
    np.testing.assert_array_equal([s["loss"] for s in log_a], [s["loss"] for s in log_b])
    a, _ = load_adapters(a_dir / "adapters")
    b, _ = load_adapters(b_dir / "adapters")
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_time_limited_run_resumes_to_the_same_end(model_dirs, full_run, tmp_path):
    out = tmp_path / "run"
    first = _run(model_dirs, out, dropout=0.1, max_steps=6, max_minutes=1e-5)
    assert first["stopped_by_time"] and first["steps"] == 0 and (out / "state").is_dir()
    again = _run(model_dirs, out, dropout=0.1, max_steps=6, resume=True)
    assert again["steps"] == 6 and not again["stopped_by_time"]
    _same_run(full_run[0], out)


def test_resumed_run_ends_like_an_uninterrupted_one(model_dirs, full_run, tmp_path):
    full_dir, full = full_run
    stopped = _run(model_dirs, tmp_path / "resumed", dropout=0.1, max_steps=6, stop_after_steps=3)
    assert stopped["out"] is None and not (tmp_path / "resumed").exists()
    assert (tmp_path / "resumed.partial" / "checkpoints" / "2").is_dir()
    resumed = _run(model_dirs, tmp_path / "resumed", dropout=0.1, max_steps=6, resume=True)
    assert resumed["resumed_from"] == 2 and resumed["steps"] == full["steps"] == 6
    assert not (tmp_path / "resumed.partial").exists()
    _same_run(full_dir, tmp_path / "resumed")
    a, cfg_a = load_adapters(full_dir / "adapters")
    assert cfg_a["rank"] == 4 and cfg_a["steps"] == 6
    # training moved the adapters, u and b
    assert np.any(np.asarray(a["lora"]["layers"]["0"]["mlp"]["expert_up"]["b"]))
    assert np.any(np.asarray(a["u"]["1"])) and np.any(np.asarray(a["bias"]["1"]))
    # the output directory is a converted model whose logits are the merged adapters'
    base = load_model(str(model_dirs / "moe"), progress=False).model
    tuned = load_model(str(full_dir), progress=False).model
    tokens = _tokens(2, 20)
    want = lora_logits(base, AdapterSet(a["lora"], a["u"], a["bias"], scale=32 / 4), tokens)
    np.testing.assert_allclose(np.asarray(tuned(tokens)), np.asarray(want), atol=2e-5)
    assert (full_dir / "loss.png").stat().st_size > 1000
    manifest = json.loads((full_dir / "cmoe_manifest.json").read_text())
    assert manifest["finetune"]["steps"] == 6 and manifest["method"] == "moe"


SHARDED = r'''
import json, os, sys
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax, numpy as np
from cmoe_jax.train import TrainSettings, finetune, load_adapters
assert jax.device_count() == 8
root, out = sys.argv[1], sys.argv[2]
kw = dict(data_path=root + "/text.txt", samples=8, seqlen=32, batch_size=4, lora_rank=4,
          lr=1e-2, router_lr=1e-2, bias_speed=1e-2, epochs=3, save_every=100)
one = finetune(root + "/moe", TrainSettings.from_flags(mesh_shape=(1, 1), **kw), out=out + "/one",
               devices=jax.devices()[:1], progress=False)
many = finetune(root + "/moe", TrainSettings.from_flags(mesh_shape=(4, 2), **kw), out=out + "/many", progress=False)
import cmoe_jax.moe.expert_parallel as ep
exchanges = []
_exchange = ep._exchange
ep._exchange = lambda *a, **k: exchanges.append(a[5]) or _exchange(*a, **k)  # traced all-to-all
expert = finetune(root + "/moe", TrainSettings.from_flags(mesh_shape=(2, 2), expert_parallel=2, **kw),
                  out=out + "/expert", progress=False)
assert one["mesh"] == {"data": 1, "model": 1} and many["mesh"] == {"data": 4, "model": 2}
assert expert["mesh"] == {"data": 2, "expert": 2, "model": 2}, expert["mesh"]
logs = {k: [s["loss"] for s in json.load(open(f"{out}/{k}/train_log.json"))["steps"]]
        for k in ("one", "many", "expert")}
a, _ = load_adapters(out + "/one/adapters")
def diff(k):
    b, _ = load_adapters(f"{out}/{k}/adapters")
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
print(json.dumps({**logs, "param_diff": diff("many"), "expert_param_diff": diff("expert"),
                  "exchanges": len(exchanges)}))
'''


def test_eight_devices_train_like_one(model_dirs, tmp_path):
    """Data x model = 4 x 2 and data x expert x model = 2 x 2 x 2 simulated CPU devices (the
    latter expert-parallel: routed experts split over 2 devices, tokens exchanged by
    all-to-all) against one device: per-step losses within 1e-5 relative, final adapters /
    u / b within 1e-5 absolute (float32 reductions reorder)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(8))
    proc = subprocess.run([sys.executable, "-c", SHARDED, str(model_dirs), str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res["one"]) == len(res["many"]) == len(res["expert"]) == 6
    for k, d in (("many", "param_diff"), ("expert", "expert_param_diff")):
        rel = np.max(np.abs(np.subtract(res[k], res["one"])) / np.abs(res["one"]))
        print(f"8 devices ({k}) vs 1: max relative loss difference {rel:.2e}, "
              f"max parameter difference {res[d]:.2e}")
        np.testing.assert_allclose(res[k], res["one"], rtol=1e-5)
        assert res[d] < 1e-5
    assert res["exchanges"] > 0  # the expert-parallel run really exchanged tokens
    assert res["one"][-1] < res["one"][0]  # it learns


def _cli(model_dirs, out, *extra, model="moe"):
    argv = ["--model", str(model_dirs / model), "--data-path", str(model_dirs / "text.txt"),
            "--samples", "8", "--seqlen", "32", "--batch-size", "2", "--lora-rank", "4",
            "--out", str(out), "--no-progress", *extra]
    return train_main(argv)


@pytest.mark.parametrize("extra,model,message", [
    (("--targets", "q_proj,foo"), "moe", "unknown LoRA target 'foo'"),
    (("--targets", "expert_up"), "dense", "matches no weight of this model"),
    (("--samples", "5000"), "moe", "fewer than --samples 5000"),
    (("--batch-size", "16"), "moe", "exceeds --samples"),
    (("--mesh", "four"), "moe", "is not of the form DATAxMODEL"),
    (("--mesh", "64x2"), "moe", "needs 128 devices"),
    (("--expert-parallel", "4"), "moe", "must divide the number of routed experts"),
    (("--expert-parallel", "2"), "dense", "the model has none"),
    (("--lora-rank", "0"), "moe", "--lora-rank must be at least 1"),
])
def test_bad_input_fails_before_training(model_dirs, tmp_path, capsys, extra, model, message):
    assert _cli(model_dirs, tmp_path / "out", *extra, model=model) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_resume_with_another_configuration_is_refused(model_dirs, tmp_path, capsys):
    out = tmp_path / "run"
    _run(model_dirs, out, max_steps=4, stop_after_steps=2)
    ckpt = out.with_name("run.partial") / "checkpoints"
    before = sorted(p.name for p in ckpt.iterdir())
    code = _cli(model_dirs, out, "--resume", "--lr", "0.5", "--lora-rank", "4")
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: --resume:") and "lr" in err, err
    assert sorted(p.name for p in ckpt.iterdir()) == before  # nothing trained or written
    # and a plain rerun onto the interrupted run asks for --resume / --overwrite
    assert _cli(model_dirs, out) == 2
    assert "--resume" in capsys.readouterr().err


def test_a_merged_model_with_a_non_finite_weight_is_refused_naming_it(models):
    from cmoe_jax.errors import TrainError
    from cmoe_jax.train.run import check_finite

    dense, _ = models
    check_finite(dense)  # a finite model passes
    graphdef, state = nnx.split(dense)
    flat = dict(nnx.to_flat_state(state))
    path = next(p for p in flat if p[-1] == "down")
    value = np.asarray(flat[path].get_value()).copy()
    value.flat[3] = np.inf
    flat[path].set_value(jnp.asarray(value))
    broken = nnx.merge(graphdef, nnx.from_flat_state(flat))
    with pytest.raises(TrainError, match=r"mlp/down of the model NaN or infinite: nothing was written"):
        check_finite(broken)


@pytest.mark.parametrize("alpha", [1e23, 8001.0, float("nan"), 0.0])
def test_an_absurd_lora_alpha_is_refused_before_any_work(alpha):
    from cmoe_jax.errors import TrainError

    with pytest.raises(TrainError, match="--lora-alpha .* scales the adapters' update"):
        LoRAConfig(rank=8, alpha=alpha).validate()
    LoRAConfig(rank=8, alpha=8000.0).validate()  # 1000 x the rank: the largest accepted

"""Recovery from the dense model (`train --distill`, `--recover layerwise`) on tiny random
models: the KD loss against a numpy recomputation, a student equal to its teacher, the
teacher sharing the student's weights, exact resumption, refused teachers, and layer-wise
recovery lowering every layer's FFN error."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.ffn_layer_error import dense_targets, layer_errors
from cmoe_jax.checkpoint import save_converted
from cmoe_jax.data import load_text_tokens
from cmoe_jax.loading import load_model
from cmoe_jax.sharding import make_mesh, placed_split
from cmoe_jax.train import (AdapterSet, DistillConfig, LoRAConfig, RecoverConfig, SharedTeacher, TrainSettings,
                            chunked_kd, distill_objective, finetune, init_adapters, kd_tile,
                            layerwise_recover, load_adapters, merge_adapters, router_params)
from cmoe_jax.train.cli import main as train_main
from cmoe_jax.train.data import training_windows
from conftest import WORDS, dense_and_converted, save_tiny_tokenizer, write_random_text, xla_flags
from test_train import CFG, models  # noqa: F401  (the tiny dense model and its S2A2E8 conversion)


@pytest.fixture(scope="module")
def dirs(models, tmp_path_factory):
    """`dense/` and its conversion `moe/` (whose manifest names `dense/` as its source), a
    copy of `dense/`, a teacher with another vocabulary size, one with other token ids, and
    a text file."""
    root = tmp_path_factory.mktemp("distill")
    dense, moe = (_sharpened(m) for m in models)
    save_converted(dense, {"source_model": "tiny", "method": "dense"}, root / "dense")
    save_tiny_tokenizer(root / "dense" / "tokenizer")
    save_converted(moe, {"source_model": str(root / "dense"), "method": "cmoe"}, root / "moe")
    save_tiny_tokenizer(root / "moe" / "tokenizer")
    save_converted(dense, {"source_model": "tiny", "method": "dense"}, root / "copy")
    save_tiny_tokenizer(root / "copy" / "tokenizer")
    wide, _ = dense_and_converted(dataclasses.replace(CFG, vocab_size=128), "S2A2E8")
    save_converted(wide, {"source_model": "tiny", "method": "dense"}, root / "wide")
    save_tiny_tokenizer(root / "wide" / "tokenizer")
    save_converted(dense, {"source_model": "tiny", "method": "dense"}, root / "other")
    _save_reversed_tokenizer(root / "other" / "tokenizer")
    write_random_text(root / "text.txt", 3000)
    return root


def _sharpened(model, factor: float = 30.0):
    """A copy with its LM head scaled: a random tiny model's next-token distributions are
    almost uniform, which leaves nothing to distil."""
    from cmoe_jax.models.adapters import _copy

    out = _copy(model)
    out.lm_head[...] = model.lm_head[...] * factor
    return out


def _save_reversed_tokenizer(path):
    """The tiny tokenizer's words with other ids (same size, another vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[BOS]": 1, **{w: i + 2 for i, w in enumerate(reversed(WORDS))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]").save_pretrained(str(path))


def _numpy_kd(zs, zt, labels, temperature, top_k):
    """KL(teacher || student) * T^2 and the student's NLL per position, in float64 numpy."""
    zs, zt = np.asarray(zs, np.float64), np.asarray(zt, np.float64)

    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    nll = -np.take_along_axis(log_softmax(zs), labels[..., None], -1)[..., 0]
    if top_k is not None:
        idx = np.argsort(-zt, axis=-1)[..., :top_k]
        zs, zt = np.take_along_axis(zs, idx, -1), np.take_along_axis(zt, idx, -1)
    lt, ls = log_softmax(zt / temperature), log_softmax(zs / temperature)
    return temperature ** 2 * (np.exp(lt) * (lt - ls)).sum(-1), nll


@pytest.mark.parametrize("temperature,top_k", [(1.0, None), (2.0, None), (1.5, 7)])
def test_kd_loss_matches_numpy(temperature, top_k):
    rng = np.random.default_rng(0)
    b, t, d, v = 2, 13, 8, 40  # 13 positions: tiles of 5 leave a padded remainder
    hs, ht = rng.normal(size=(b, t, d)), rng.normal(size=(b, t, d))
    head_s, head_t = rng.normal(size=(d, v)), rng.normal(size=(d, v))
    labels = rng.integers(0, v, (b, t))
    cfg = DistillConfig(temperature=temperature, top_k=top_k)
    want_kl, want_nll = _numpy_kd(hs @ head_s, ht @ head_t, labels, temperature, top_k)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    kl, nll = chunked_kd(f32(hs), f32(ht), jnp.asarray(labels), f32(head_s), f32(head_t), cfg, chunk=5)
    np.testing.assert_allclose(np.asarray(kl), want_kl, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(np.asarray(nll), want_nll, rtol=2e-5, atol=2e-5)
    assert want_kl.min() > 1e-3  # different logits: the test compares non-trivial values
    one_kl, _ = kd_tile(f32(hs @ head_s), f32(ht @ head_t), jnp.asarray(labels), cfg)
    np.testing.assert_allclose(np.asarray(one_kl), want_kl, rtol=2e-4, atol=2e-5)


def _tokens(b=2, t=16, seed=3):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 96, (b, t)), jnp.int32)


@pytest.mark.parametrize("top_k", [None, 5])
def test_student_equal_to_teacher_has_zero_loss_and_gradient(models, top_k):
    """Fresh adapters (B = 0) leave the student equal to its teacher: KD loss and hidden
    matching are 0 and so are their gradients; moved adapters give a positive loss."""
    dense, _ = models
    lora = LoRAConfig(rank=4)
    adapters = init_adapters(dense, lora, jax.random.key(0))
    cfg = DistillConfig(temperature=2.0, top_k=top_k, hidden_weight=1.0)
    tokens = _tokens()

    def loss(a):
        return distill_objective(dense, dense, lora.applied(a), tokens, cfg)[0]

    value, grads = jax.value_and_grad(loss)(adapters)
    assert abs(float(value)) < 1e-6
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads)) < 1e-5
    moved = jax.tree.map(lambda a: a + 0.05, adapters)
    assert float(loss(moved)) > 1e-3


def test_teacher_borrows_the_students_shared_weights(models):
    """The converted model's attention, norms and embeddings are its source's: the teacher
    rebuilt from the student's arrays and its own FFNs computes the dense model's logits."""
    dense, moe = models
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    _, student = placed_split(moe, mesh)
    t_graphdef, t_state = placed_split(dense, mesh)
    teacher = SharedTeacher(t_graphdef, t_state, student)
    assert all("mlp" in k for k in teacher.own) and teacher.own  # only the dense FFNs are its own
    assert teacher.memory()["teacher_shared_bytes"] > 0
    rebuilt = jax.jit(lambda s, o, t: teacher.model(s, o)(t))(student, teacher.own, _tokens())
    np.testing.assert_allclose(np.asarray(rebuilt), np.asarray(dense(_tokens())), atol=1e-5)


def _run(dirs, out, **kw):
    args = dict(data_path=str(dirs / "text.txt"), samples=8, seqlen=32, batch_size=2,
                lora_rank=4, lr=1e-2, router_lr=1e-2, bias_speed=1e-2, epochs=2, save_every=2,
                progress=False, distill=True, kd_temperature=2.0, kd_weight=0.7, hidden_weight=0.5)
    args.update(kw)
    job, options = TrainSettings.split_options(args)
    return finetune(str(dirs / "moe"), job, out=out, **options)


def _same_run(a_dir, b_dir, steps):
    log_a = json.loads((a_dir / "train_log.json").read_text())["steps"]
    log_b = json.loads((b_dir / "train_log.json").read_text())["steps"]
    assert len(log_a) == len(log_b) == steps
    np.testing.assert_array_equal([s["loss"] for s in log_a], [s["loss"] for s in log_b])
    for sub in ("adapters", "recover"):
        if (a_dir / sub).exists() or (b_dir / sub).exists():
            a, _ = load_adapters(a_dir / sub)
            b, _ = load_adapters(b_dir / sub)
            assert jax.tree.structure(a) == jax.tree.structure(b)
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_distillation_moves_the_student_towards_its_teacher(dirs, tmp_path):
    """Pure KD (weight 1) on one batch seen 8 times: the logged KL falls, and the published
    (merged) model is closer to the teacher on that batch than the converted one."""
    res = _run(dirs, tmp_path / "kd", samples=2, epochs=8, kd_weight=1.0, hidden_weight=0.0,
               kd_temperature=1.0, lr=2e-4, router_lr=2e-4, bias_speed=0.0)
    log = [s["loss"] for s in json.loads((tmp_path / "kd" / "train_log.json").read_text())["steps"]]
    assert res["steps"] == 8 and log[-1] < 0.8 * log[0], log
    lm = load_model(str(dirs / "moe"), progress=False)
    batch = training_windows(load_text_tokens("wikitext2", lm.tokenizer,
                                              data_path=str(dirs / "text.txt")), 2, 32, 0)
    tuned, base = _kl_to_teacher(dirs, tmp_path / "kd", batch), _kl_to_teacher(dirs, dirs / "moe", batch)
    assert tuned < 0.8 * base and abs(tuned - log[-1]) < abs(base - log[-1]), (tuned, base, log)


def _kl_to_teacher(dirs, model_dir, batch) -> float:
    """Mean KL of a saved model to the dense teacher on `batch`."""
    model = load_model(str(model_dir), progress=False).model
    dense = load_model(str(dirs / "dense"), progress=False).model
    return float(distill_objective(model, dense, AdapterSet({}), jnp.asarray(batch), DistillConfig())[0])


@pytest.mark.parametrize("recover", [None, "layerwise"])
def test_interrupted_distillation_resumes_bit_identically(dirs, tmp_path, recover):
    kw = dict(max_steps=6, recover=recover, recover_samples=4, recover_steps=20)
    full = _run(dirs, tmp_path / "full", **kw)
    assert full["teacher"] == str(dirs / "dense") and full["teacher_own_bytes"] > 0
    manifest = json.loads((tmp_path / "full" / "cmoe_manifest.json").read_text())
    assert manifest["finetune"]["distill"]["kd_weight"] == 0.7
    stopped = _run(dirs, tmp_path / "resumed", stop_after_steps=3, **kw)
    assert stopped["out"] is None
    resumed = _run(dirs, tmp_path / "resumed", resume=True, **kw)
    assert resumed["resumed_from"] == 2
    _same_run(tmp_path / "full", tmp_path / "resumed", 6)
    if recover:
        assert (tmp_path / "full" / "recover").is_dir()
        assert all(r["after"] < r["before"] for r in full["recover_layers"])


def test_resume_with_another_teacher_is_refused(dirs, tmp_path, capsys):
    out = tmp_path / "run"
    _run(dirs, out, max_steps=4, stop_after_steps=2)
    ckpt = out.with_name("run.partial") / "checkpoints"
    before = sorted(p.name for p in ckpt.iterdir())
    code = _cli(dirs, out, "--distill", "--kd-temperature", "2", "--kd-weight", "0.7",
                "--hidden-weight", "0.5", "--teacher", str(dirs / "copy"), "--resume",
                "--lr", "1e-2", "--router-lr", "1e-2", "--bias-speed", "1e-2", "--epochs", "2",
                "--save-every", "2", "--max-steps", "4")
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: --resume:") and "teacher" in err, err
    assert "\n" not in err and sorted(p.name for p in ckpt.iterdir()) == before


def _cli(dirs, out, *extra, model="moe"):
    argv = ["--model", str(dirs / model), "--data-path", str(dirs / "text.txt"), "--samples", "8",
            "--seqlen", "32", "--batch-size", "2", "--lora-rank", "4", "--out", str(out),
            "--no-progress", *extra]
    return train_main(argv)


@pytest.mark.parametrize("extra,model,message", [
    (("--distill", "--teacher", "wide"), "moe", "vocabulary of 128 tokens, the student 96"),
    (("--distill", "--teacher", "other"), "moe", "another tokenizer than the student"),
    (("--distill",), "dense", "cannot open the teacher 'tiny'"),
    (("--teacher", "dense"), "moe", "add --distill"),
    (("--distill", "--kd-weight", "1.5"), "moe", "--kd-weight"),
    (("--recover", "layerwise", "--recover-samples", "9"), "moe", "--recover-samples must be"),
    (("--max-steps", "0"), "moe", "needs --recover layerwise"),
])
def test_bad_teacher_or_mode_fails_with_one_line(dirs, tmp_path, capsys, extra, model, message):
    extra = tuple(str(dirs / e) if e in ("wide", "other", "dense") else e for e in extra)
    assert _cli(dirs, tmp_path / "out", *extra, model=model) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_layerwise_recovery_lowers_every_layers_ffn_error(models):
    """Per-layer relative FFN error against the dense FFN on the dense model's own FFN inputs
    (`benchmarks/ffn_layer_error.py`) of held-out windows, before and after layer-wise
    recovery fitted on 64 other windows (with 8 the tiny model's adapters overfit)."""
    dense, moe = models
    lora = LoRAConfig(rank=4)
    calib = np.random.default_rng(1).integers(0, 96, (64, 32)).astype(np.int32)
    adapters, us, records = layerwise_recover(moe, dense, calib, lora,
                                              RecoverConfig(samples=64, steps=150, lr=3e-3),
                                              jax.random.key(0), progress=False)
    assert set(us) == set(router_params(moe)[0]) and len(records) == CFG.num_layers
    recovered = merge_adapters(moe, adapters, lora.scale, us, None)
    xs, ys = dense_targets(dense, _tokens(4, 32, seed=9))
    before, after = layer_errors(moe, xs, ys), layer_errors(recovered, xs, ys)
    print("layer-wise recovery, FFN error before / after:", before, after)
    assert all(a < 0.8 * b for a, b in zip(after, before)), (before, after)
    assert all(r["after"] < 0.5 * r["before"] for r in records)  # on its own calibration inputs


def test_layerwise_alone_publishes_the_recovered_model(dirs, tmp_path):
    """`--recover layerwise --max-steps 0`: no global step, the output is the student with
    its layer-wise adapters merged."""
    res = _run(dirs, tmp_path / "lw", distill=False, recover="layerwise", max_steps=0,
               recover_samples=4, recover_steps=20)
    assert res["steps"] == 0 and res["teacher"] == str(dirs / "dense")
    assert (tmp_path / "lw" / "recover").is_dir() and (tmp_path / "lw" / "state").is_dir()


SHARDED = r'''
import json, os, sys
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax, numpy as np
from cmoe_jax.train import TrainSettings, finetune, load_adapters
root, out = sys.argv[1], sys.argv[2]
kw = dict(data_path=root + "/text.txt", samples=8, seqlen=32, batch_size=4, lora_rank=4, lr=1e-2,
          router_lr=1e-2, bias_speed=1e-2, epochs=2, distill=True, kd_temperature=2.0,
          kd_weight=0.7, kd_top_k=20, hidden_weight=0.5)
one = finetune(root + "/moe", TrainSettings.from_flags(mesh_shape=(1, 1), **kw), out=out + "/one",
               devices=jax.devices()[:1], progress=False)
many = finetune(root + "/moe", TrainSettings.from_flags(mesh_shape=(4, 2), **kw), out=out + "/many", progress=False)
logs = {k: [s["loss"] for s in json.load(open(f"{out}/{k}/train_log.json"))["steps"]] for k in ("one", "many")}
a, _ = load_adapters(out + "/one/adapters")
b, _ = load_adapters(out + "/many/adapters")
diff = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
           for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
print(json.dumps({**logs, "mesh": many["mesh"], "param_diff": diff}))
'''


def test_distillation_on_eight_devices_trains_like_one(dirs, tmp_path):
    """Data x model = 4 x 2 simulated CPU devices against one: the teacher's own weights are
    sharded like the student's; per-step losses within 1e-5 relative, adapters within 1e-5."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(8))
    proc = subprocess.run([sys.executable, "-c", SHARDED, str(dirs), str(tmp_path)],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["mesh"] == {"data": 4, "model": 2} and len(res["one"]) == len(res["many"]) == 4
    np.testing.assert_allclose(res["many"], res["one"], rtol=1e-5)
    assert res["param_diff"] < 1e-5

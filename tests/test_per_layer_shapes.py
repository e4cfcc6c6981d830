"""A conversion whose layers differ in shape (`convert --active F`, or shapes given per
layer, a kept-dense layer among them) runs everywhere a uniform one does, each checked
against a reference computed apart from the path under test: save and load, perplexity
and a multiple-choice task, cached generation, a LoRA and a distillation step, the
transformers export, ConMoE compression, an interrupted and resumed budget conversion
(its damage rows reused) and the streamed budget conversion."""
from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import cmoe_jax.methods.cmoe.sensitivity as sensitivity_module
from cmoe_jax.checkpoint import PER_LAYER, restore_model, save_converted, write_manifest
from cmoe_jax.compress.cli import main as compress_main
from cmoe_jax.convert import Calibration, ConvertConfig, ConvertSettings, convert, convert_model
from cmoe_jax.convert.cli import main as convert_main
from cmoe_jax.data import eval_windows, load_text_tokens
from cmoe_jax.errors import CmoeError
from cmoe_jax.eval.cli import main as eval_main
from cmoe_jax.eval.loglikelihood import encode_pair
from cmoe_jax.export import ExportSettings, export
from cmoe_jax.generate import Decoding, generate
from cmoe_jax.loading import load_config, load_model, load_tokenizer, open_source, window_bos
from cmoe_jax.methods.cmoe import MoEPlan
from cmoe_jax.methods.cmoe.streamed import Streamed, convert_streamed
from cmoe_jax.methods.cmoe.budget import Budget
from cmoe_jax.methods.conmoe import ScopePlan
from cmoe_jax.methods.conmoe.build import materialize
from cmoe_jax.methods.conmoe.job import CompressConfig, check_inputs
from cmoe_jax.train import TrainSettings, finetune
from cmoe_jax.train.data import training_windows
from conftest import save_tiny_tokenizer, tiny_hf_model, write_random_text
from test_export_moe import TOKENS, trained, transformers_logits
from test_loglikelihood import own_scores
from test_tasks import write_arc_like

# layer 1 keeps its dense FFN; the others differ in shared, active and routed experts
PLANS = (MoEPlan(0, 1, 8), None, MoEPlan(2, 2, 8), MoEPlan(1, 2, 8))
CALIB = np.random.default_rng(0).integers(0, 96, (2, 32)).astype(np.int32)
ACTIVE = ["--active", "0.375", "--calib-samples", "2", "--seqlen", "32", "--k-act", "4",
          "--no-progress"]  # the default (marginal) measure: both of its passes, and their logs, are exercised
_FORWARD = nnx.jit(lambda model, tokens: model(tokens))  # compiled once per model structure and shape


def _logits(model, tokens) -> np.ndarray:
    return np.asarray(_FORWARD(model, jnp.asarray(tokens, jnp.int32)))


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A tiny 4-layer Llama checkpoint with a tokenizer, and a text file."""
    root = tmp_path_factory.mktemp("per_layer")
    tiny_hf_model("llama", intermediate_size=64, num_hidden_layers=4).save_pretrained(root / "dense")
    save_tiny_tokenizer(root / "dense")
    write_random_text(root / "text.txt", 4000)
    return root


@pytest.fixture(scope="module")
def hetero(src):
    """(dense model, its conversion to `PLANS` in memory, that conversion saved with a
    tokenizer and a manifest naming the dense checkpoint as its source)."""
    dense = load_model(str(src / "dense"), progress=False).model
    moe, _ = convert_model(dense, CALIB, ConvertConfig(plan=None, layer_plans=PLANS, k_act=4), progress=False)
    save_converted(moe, {"source_model": str(src / "dense"), "method": "cmoe"}, src / "hetero")
    save_tiny_tokenizer(src / "hetero" / "tokenizer")
    return dense, moe, src / "hetero"


@pytest.fixture(scope="module")
def adaptive(src):
    """`convert --active 0.375` in memory (each layer's shape chosen for the budget)."""
    out = src / "adaptive"
    assert convert_main(["--model", str(src / "dense"), "--data-path", str(src / "text.txt"),
                         "--out", str(out), *ACTIVE]) == 0
    return out


def _flat(model) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def _assert_same_state(a, b):
    fa, fb = _flat(a), _flat(b)
    assert list(fa) == list(fb)
    for p in fa:
        np.testing.assert_array_equal(fa[p], fb[p], err_msg=str(p))


def _log_softmax(logits) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _nll(model, windows) -> np.ndarray:
    """Per-token next-token NLL [B, T-1] from the model's plain logits, in float64."""
    logp = _log_softmax(_logits(model, windows))[:, :-1]
    return -np.take_along_axis(logp, np.asarray(windows)[:, 1:, None], -1)[..., 0]


def test_the_layers_differ_and_the_dense_layer_is_the_sources(hetero):
    dense, moe, _ = hetero
    specs = moe.config.moe_layers
    assert isinstance(moe.layers, nnx.List) and specs[1] is None
    assert [(s.num_experts, s.top_k, s.shared_width) for s in specs if s] == [(8, 1, 0), (6, 2, 16), (7, 2, 8)]
    for name in ("gate", "up", "down"):
        np.testing.assert_array_equal(getattr(moe.layers[1].mlp, name)[...], getattr(dense.layers[1].mlp, name)[...])


def test_saved_model_loads_with_the_same_logits(hetero):
    _, moe, path = hetero
    loaded = load_model(str(path), progress=False).model
    assert loaded.config == moe.config
    np.testing.assert_array_equal(_logits(loaded, TOKENS), _logits(moe, TOKENS))


def test_budget_manifest_describes_each_layer(adaptive):
    manifest = json.loads((adaptive / "cmoe_manifest.json").read_text())
    specs = load_model(str(adaptive), progress=False).config.moe_layers
    assert len({s for s in specs}) > 1, "the budget gave every layer one shape: nothing differs"
    for entry, spec in zip(manifest["plan"], specs):
        if spec is None:
            assert entry["dense"]
        else:
            assert (spec.num_experts, spec.top_k) == (entry["experts"] - entry["shared"], entry["active"])
            assert spec.shared_width == entry["shared"] * entry["expert_width"]
    shares = [1.0 if e.get("dense") else (e["shared"] + e["active"]) / e["experts"] for e in manifest["plan"]]
    assert manifest["active_share"] == pytest.approx(np.mean(shares))
    assert np.mean(shares) == pytest.approx(0.375)


def test_perplexity_and_a_task(hetero, src, tmp_path):
    _, moe, path = hetero
    out = tmp_path / "ppl.json"
    assert eval_main(["--model", str(path), "--data-path", str(src / "text.txt"), "--seqlen", "32",
                      "--max-windows", "4", "--json", str(out), "--no-progress"]) == 0
    tok = load_tokenizer(path)
    windows = eval_windows(load_text_tokens("wikitext2", tok, data_path=str(src / "text.txt")), "wikitext2",
                           32, 4, bos=window_bos(load_config(path)[0], tok))
    assert json.loads(out.read_text())["nll"] == pytest.approx(_nll(moe, windows).mean(), abs=1e-5)

    data, out = write_arc_like(tmp_path / "arc.jsonl", n=6), tmp_path / "arc.json"
    assert eval_main(["--model", str(path), "--task", "arc_easy", "--data-path", str(data), "--batch-size", "4",
                      "--json", str(out), "--no-progress"]) == 0
    docs = [json.loads(line) for line in data.read_text().splitlines()]
    requests = [encode_pair(tok.encode, f"Question: {d['question']}\nAnswer:", " " + t)
                for d in docs for t in d["choices"]["text"]]
    ref = [ll for ll, _ in own_scores(lambda t: _logits(moe, t), requests)]
    got = [ll for lls in json.loads(out.read_text())["loglikelihoods"] for ll in lls]
    np.testing.assert_allclose(got, ref, atol=1e-4)


def test_cached_generation_equals_greedy_decoding_without_a_cache(hetero):
    _, moe, _ = hetero
    prompts, new = [[5, 17, 40, 3], [9], [60, 61, 62, 63, 64, 65, 66]], 8
    width = max(map(len, prompts)) + new
    rows = [list(p) for p in prompts]
    for _ in range(new):  # the whole sequence each step, right-padded (a causal model ignores it)
        padded = np.asarray([r + [0] * (width - len(r)) for r in rows], np.int32)
        logits = _logits(moe, padded)
        rows = [r + [int(logits[i, len(r) - 1].argmax())] for i, r in enumerate(rows)]
    assert generate(moe, prompts, Decoding(new)) == [r[len(p):] for r, p in zip(rows, prompts)]


def _train(path, text, out, **kw):
    args = dict(data_path=str(text), samples=2, seqlen=32, batch_size=2, lora_rank=4, lr=1e-2, router_lr=1e-2,
                bias_speed=1e-2, epochs=1, max_steps=1, progress=False, **kw)
    job, options = TrainSettings.split_options(args)
    return finetune(str(path), job, out=out, **options)


@nnx.jit
def _ffn_inputs(model, tokens) -> list:
    """Each layer's FFN input, running the layers one by one."""
    h, rope, xs = model.embed_tokens(tokens), model.rope(tokens.shape[1]), []
    for layer in model.layers:
        out = layer(h, rope)
        h = out.h
        xs.append(out.ffn_input)
    return xs


def test_one_lora_step_and_one_distillation_step(hetero, src, tmp_path):
    """The first step's loss (adapters start at zero) against the converted model's own NLL,
    and with the dense source as teacher, its KL, NLL and FFN-input terms."""
    dense, moe, path = hetero
    tok = load_tokenizer(path)
    batch = training_windows(load_text_tokens("wikitext2", tok, data_path=str(src / "text.txt")), 2, 32, 0)
    nll = _nll(moe, batch).mean()
    lora = _train(path, src / "text.txt", tmp_path / "lora")
    assert lora["steps"] == 1 and np.isfinite(lora["first_loss"]) and lora["first_loss"] == pytest.approx(nll, rel=1e-5)

    kd = _train(path, src / "text.txt", tmp_path / "kd", distill=True, kd_temperature=2.0, kd_weight=0.7,
                hidden_weight=0.5)
    assert kd["steps"] == 1 and kd["teacher"] == str(src / "dense") and np.isfinite(kd["first_loss"])
    ls, lt = (_log_softmax(_logits(m, batch)[:, :-1] / 2.0) for m in (moe, dense))
    kl = 4.0 * (np.exp(lt) * (lt - ls)).sum(-1).mean()
    inputs = [[np.asarray(x, np.float64) for x in _ffn_inputs(m, jnp.asarray(batch))] for m in (moe, dense)]
    hidden = np.mean([((s - t) ** 2).sum() / (t ** 2).sum() for s, t in zip(*inputs)])
    assert kd["first_loss"] == pytest.approx(0.7 * kl + 0.3 * nll + 0.5 * hidden, rel=1e-4)


def test_export_gives_our_logits_in_transformers(hetero, src, tmp_path):
    """A heterogeneous conversion exported to transformers gives our logits (1e-4), with
    router scales and biases made non-zero as after fine-tuning."""
    _, _, path = hetero
    model = trained(load_model(str(path), progress=False).model)
    save_converted(model, {"source_model": "tiny", "method": "cmoe"}, tmp_path / "converted")
    save_tiny_tokenizer(tmp_path / "converted" / "tokenizer")
    record = export(str(tmp_path / "converted"), ExportSettings(data_path=str(src / "text.txt"), calib_samples=2,
                                                                 seqlen=32), out=tmp_path / "hf", progress=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["moe_layers"][1] is None and record["verification"]["max_abs_logit_diff"] < 1e-4
    np.testing.assert_allclose(transformers_logits(tmp_path / "hf"), _logits(model, TOKENS), atol=1e-4)


def test_compression_leaves_the_dense_layer_and_equals_the_copied_checkpoint(hetero, src, tmp_path):
    """ConMoE over scopes of two MoE layers (8 and 6 routed experts sharing one table): the
    kept-dense layer is left as it is, and the saved model gives the logits of the original
    architecture with each slot holding its prototype's weights (`materialize`)."""
    _, moe, path = hetero
    out = tmp_path / "compressed"
    assert compress_main(["--model", str(path), "--data-path", str(src / "text.txt"), "--calib-samples", "2",
                          "--seqlen", "32", "--method", "conmoe", "--ratio", "0.5", "--scope", "2",
                          "--report", "--out", str(out), "--no-progress"]) == 0
    manifest = json.loads((out / "cmoe_manifest.json").read_text())
    assert [s["layers"] for s in manifest["scopes"]] == [[0, 2], [3]]
    assert (out / "report" / "slot_map.png").exists()
    plans = [ScopePlan(s["layers"], np.asarray(s["mix"]),
                       {int(k): np.asarray(v, np.int32) for k, v in s["slot_maps"].items()}) for s in manifest["scopes"]]
    compressed = load_model(str(out), progress=False).model
    assert compressed.config.moe_layers[1] is None
    assert compressed.layers[2].mlp.expert_gate is compressed.layers[0].mlp.expert_gate
    for name, value in _flat(moe.layers[1]).items():
        np.testing.assert_array_equal(_flat(compressed.layers[1])[name], value)
    np.testing.assert_allclose(_logits(compressed, TOKENS), _logits(materialize(moe, plans), TOKENS), atol=1e-5)


def _budget_job(src) -> ConvertSettings:
    return ConvertSettings(ConvertConfig(plan=None, k_act=4),
                           Calibration(data_path=str(src / "text.txt"), samples=2, seqlen=32),
                           budget=Budget(0.375))


def test_interrupted_budget_conversion_resumes_bit_identically(src, adaptive, tmp_path, monkeypatch):
    """Killed while measuring layer 2's stream errors, then after converting two layers:
    each resume measures only the rows, gains and rises not saved, and the result is the
    uninterrupted one."""
    carved = []
    carve = sensitivity_module.carve_on_main
    monkeypatch.setattr(sensitivity_module, "carve_on_main", lambda *a: carved.append(1) or carve(*a))
    job, out = _budget_job(src), tmp_path / "resumed"
    assert convert(str(src / "dense"), job, out=out, stop_after_layers=1, progress=False)["out"] is None
    staging = tmp_path / "resumed.partial"
    rows, gains, rises = (sorted((staging / d).glob("*.json")) for d in ("damage", "gains", "rises"))
    assert ([p.name for p in rows] == [p.name for p in gains] == [p.name for p in rises]
            == ["0000.json", "0001.json", "0002.json", "0003.json"])
    for p in rows[2:] + gains[3:] + rises[2:] + sorted((staging / "layers").glob("*.json")):
        p.unlink()
    carved.clear()
    assert convert(str(src / "dense"), job, out=out, resume=True, stop_after_layers=2, progress=False)["out"] is None
    # layers 0 and 1 carved to the uniform shape and the one below alone (the stream goes on
    # through the first), layers 2 and 3 to every carved shape; the losses carve nothing more
    assert len(carved) == 2 * (len(Budget(0.375).candidates()) - 1) + 2 * 2
    carved.clear()
    convert(str(src / "dense"), job, out=out, resume=True, progress=False)
    assert not carved  # every row read back
    _assert_same_state(load_model(str(adaptive), progress=False).model, load_model(str(out), progress=False).model)
    a, b = (json.loads((d / "cmoe_manifest.json").read_text()) for d in (adaptive, out))
    assert a["budget"] == b["budget"] and a["plan"] == b["plan"] and a["layers"] == b["layers"]


def test_streamed_budget_conversion_equals_in_memory(src, adaptive, tmp_path):
    out = tmp_path / "streamed"
    assert convert_main(["--model", str(src / "dense"), "--data-path", str(src / "text.txt"), "--out", str(out),
                         "--stream", *ACTIVE]) == 0
    a, b = (json.loads((d / "cmoe_manifest.json").read_text()) for d in (adaptive, out))
    assert a["budget"] == b["budget"] and a["plan"] == b["plan"] and a["layers"] == b["layers"]
    _assert_same_state(restore_model(adaptive), restore_model(out))


def test_streamed_conversion_keeps_a_dense_layer(src, hetero, tmp_path):
    _, moe, _ = hetero
    cfg, path = load_config(str(src / "dense"))
    out = tmp_path / "streamed"
    cfg_moe, _ = convert_streamed(Streamed(open_source(path), cfg, out), CALIB,
                                  ConvertConfig(plan=None, layer_plans=PLANS, k_act=4), progress=False)
    write_manifest(out, cfg_moe, {"source_model": "tiny", "method": "cmoe", "state_layout": PER_LAYER})
    assert cfg_moe == moe.config
    _assert_same_state(moe, restore_model(out))


def test_only_a_scope_of_one_expert_width_shares_a_table(hetero):
    """Layers of one scope may differ in expert count, not in expert width."""
    cfg = hetero[1].config
    assert check_inputs(cfg, CompressConfig("conmoe", 0.5, scope=3), 32) == [0, 2, 3]
    wide = cfg.with_moe_layers([*cfg.moe_layers[:3], dataclasses.replace(cfg.moe_layers[3], expert_width=16)])
    assert check_inputs(wide, CompressConfig("conmoe", 0.5, scope=2), 32) == [0, 2, 3]  # scopes [0, 2], [3]
    with pytest.raises(CmoeError, match=r"MoE layers \[0, 2, 3\] of one --scope 3 differ in expert width"):
        check_inputs(wide, CompressConfig("conmoe", 0.5, scope=3), 32)

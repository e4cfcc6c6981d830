"""`python -m cmoe_jax.export --format hf`: the exported directory, read back by transformers
(original architecture, or remote code for carved MoE layers), gives our logits."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from cmoe_jax.methods.cmoe import MoEPlan
from cmoe_jax.checkpoint import save_converted
from cmoe_jax.convert import ConvertConfig, convert_model
from cmoe_jax.export import EXPORT_MANIFEST, ExportSettings, export
from cmoe_jax.export.cli import main as export_main
from cmoe_jax.loading import load_model
from conftest import save_tiny_tokenizer, write_random_text

TOKENS = np.random.default_rng(5).integers(0, 96, (2, 24)).astype(np.int32)


def exported_logits(directory):
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(directory), trust_remote_code=True,
                                                            dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.from_numpy(TOKENS.astype(np.int64))).logits.numpy()


def converted_dir(save_tiny, tmp_path, family, plan="S2A2E8", trained=True):
    """A tiny random model converted to CMoE (router scales u and biases b made non-zero, as
    after fine-tuning, so the gates matter), saved as a converted directory."""
    _, path = save_tiny(family, intermediate_size=64)
    dense = load_model(str(path), progress=False).model
    calib = np.random.default_rng(0).integers(0, 96, size=(4, 32)).astype(np.int32)
    moe, _ = convert_model(dense, calib, ConvertConfig(plan=MoEPlan.parse(plan), k_act=4), progress=False)
    if trained:
        for i, layer in enumerate(moe.unstacked().layers):  # editable copies, written back
            e = layer.mlp.num_experts
            layer.mlp.u[...] = jnp.linspace(-2.0, 2.0, e)
            layer.mlp.router_bias[...] = 0.05 * jnp.arange(e, dtype=jnp.float32)
            moe.set_layer(i, layer)
    out = tmp_path / f"{family}_moe"
    save_converted(moe, {"source_model": "tiny", "method": "cmoe"}, out)
    save_tiny_tokenizer(out / "tokenizer")
    return moe, out


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma3_text", "phi3"])
def test_carved_model_exports_with_remote_code(save_tiny, tmp_path, family):
    moe, src = converted_dir(save_tiny, tmp_path, family)
    text = write_random_text(tmp_path / "text.txt", 2000)
    record = export(str(src), ExportSettings(data_path=str(text), calib_samples=2, seqlen=32),
                    out=tmp_path / "hf", progress=False)
    assert record["remote_code"] and (tmp_path / "hf" / "modeling_cmoe.py").exists()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == f"cmoe_{family}" and config["moe_layers"][0]["router"] == "cmoe"
    np.testing.assert_allclose(exported_logits(tmp_path / "hf"), np.asarray(moe(TOKENS)), atol=1e-4)
    check = record["verification"]
    assert check["max_abs_logit_diff"] < 1e-4 and check["windows"] == 2
    assert check["perplexity_ours"] == pytest.approx(check["perplexity_transformers"], rel=1e-5)
    assert json.loads((tmp_path / "hf" / EXPORT_MANIFEST).read_text())["tensors"] == record["tensors"]
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok("w1 w2")["input_ids"][-2:] == [3, 4]


@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2", "qwen3_moe_norm", "mixtral",
                                    "mistral", "gemma3_text", "olmoe", "qwen2_moe", "phi3"])
def test_dense_and_sparse_families_export_to_their_own_architecture(save_tiny, tmp_path, family):
    _, path = save_tiny(family)
    ours = np.asarray(load_model(str(path), progress=False).model(TOKENS))
    record = export(str(path), ExportSettings(calib_samples=0), out=tmp_path / "hf", progress=False)
    assert not record["remote_code"] and not (tmp_path / "hf" / "modeling_cmoe.py").exists()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "auto_map" not in config
    np.testing.assert_allclose(exported_logits(tmp_path / "hf"), ours, atol=1e-4)


def test_fused_tensors_are_written_whole_and_read_back(save_tiny, tmp_path):
    """Phi-3 keeps q/k/v and gate/up in one tensor each: the export writes them fused, with
    the same bytes as the source checkpoint, even when its shards split a layer's parts."""
    from safetensors.numpy import load_file

    _, path = save_tiny("phi3")
    export(str(path), ExportSettings(calib_samples=0, max_shard_mb=0.01), out=tmp_path / "hf", progress=False)
    ours = {}
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        ours.update(load_file(shard))
    source = load_file(next(path.glob("*.safetensors")))
    assert "model.layers.1.self_attn.qkv_proj.weight" in ours and "model.layers.1.mlp.gate_up_proj.weight" in ours
    assert not any(".q_proj." in name or ".gate_proj." in name for name in ours)
    assert sorted(ours) == sorted(source)
    for name, array in source.items():
        np.testing.assert_array_equal(ours[name], array, err_msg=name)


def test_sharded_export_resumes_to_the_same_files(save_tiny, tmp_path):
    moe, src = converted_dir(save_tiny, tmp_path, "llama")
    kw = dict(progress=False)
    settings = ExportSettings(calib_samples=0, max_shard_mb=0.02)
    stopped = export(str(src), settings, out=tmp_path / "a", stop_after_shards=2, **kw)
    assert stopped["out"] is None and not (tmp_path / "a").exists()
    first = sorted((tmp_path / "a.partial" / "final").glob("*.safetensors"))
    assert len(first) == 2
    stamps = {f.name: f.stat().st_mtime_ns for f in first}
    record = export(str(src), settings, out=tmp_path / "a", resume=True, **kw)
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    assert record["shards"] > 2 and len(set(index["weight_map"].values())) == record["shards"]
    for name, stamp in stamps.items():  # the finished shards were kept, not rewritten
        assert (tmp_path / "a" / name).stat().st_mtime_ns == stamp
    np.testing.assert_allclose(exported_logits(tmp_path / "a"), np.asarray(moe(TOKENS)), atol=1e-4)


def test_bad_input_fails_before_writing(save_tiny, tmp_path, capsys):
    _, src = converted_dir(save_tiny, tmp_path, "llama", trained=False)
    (tmp_path / "taken").mkdir()
    capsys.readouterr()  # the fixture's own output
    cases = [(["--out", str(tmp_path / "taken")], "exists"),
             (["--out", str(tmp_path / "x"), "--seqlen", "100000"], "exceeds the model's context"),
             (["--out", str(tmp_path / "x"), "--seqlen", "32", "--data-path", str(tmp_path / "none.txt")],
              "none.txt")]
    for extra, message in cases:
        assert export_main(["--model", str(src), "--no-progress", *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and message in err, err
        assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()


def test_exported_tokenizer_loads_without_remote_code(save_tiny, tmp_path):
    """A script (no terminal to ask) loads the exported tokenizer with plain AutoTokenizer,
    no trust_remote_code, and it encodes as the source tokenizer does; the tokenizer files
    name their class, so transformers does not take it from the `cmoe_llama` config."""
    _, src = converted_dir(save_tiny, tmp_path, "llama", trained=False)
    export(str(src), ExportSettings(calib_samples=0), out=tmp_path / "hf", progress=False)
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config.get("tokenizer_class")
    text = "w1 w2 w3 w17 w40"
    ours = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    source = transformers.AutoTokenizer.from_pretrained(str(src / "tokenizer"))
    assert ours(text)["input_ids"] == source(text)["input_ids"]


def test_expertweaver_model_exports_with_remote_code(save_tiny, tmp_path):
    """ExpertWeaver's training-free top-sum router (top-k by logit, gates 1) beside its shared
    expert, read back by the remote code."""
    from cmoe_jax.methods.expertweaver import WeaveConfig, weave_model

    _, path = save_tiny("qwen3", intermediate_size=64)
    dense = load_model(str(path), progress=False).model
    calib = np.random.default_rng(0).integers(0, 96, size=(4, 32)).astype(np.int32)
    moe, _ = weave_model(dense, calib, np.repeat(np.arange(2), 2), WeaveConfig(experts=8, sparsity=0.5),
                         progress=False)
    save_converted(moe, {"source_model": "tiny", "method": "expertweaver"}, tmp_path / "woven")
    record = export(str(tmp_path / "woven"), ExportSettings(calib_samples=0), out=tmp_path / "hf",
                    progress=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert record["remote_code"] and config["moe_layers"][0]["router"] == "topsum"
    np.testing.assert_allclose(exported_logits(tmp_path / "hf"), np.asarray(moe(TOKENS)), atol=1e-4)

"""Config values of the wrong type or out of range, in `config.json`, GGUF metadata or a
manifest written before manifests were sealed, are one line naming the file and the field,
before any work (never a TypeError from inside a model)."""
from __future__ import annotations

import json
import shutil

import pytest

from cmoe_jax.checkpoint import MANIFEST
from cmoe_jax.checkpoint.seal import SEAL
from cmoe_jax.errors import CmoeError
from cmoe_jax.eval.cli import main as eval_main
from cmoe_jax.generate import main as generate_main
from cmoe_jax.loading import load_config
from cmoe_jax.models.config_fields import ConfigFieldError
from tests.test_bad_input import inputs  # noqa: F401 (fixture)

# (field, value, what the line says of it)
HF_CASES = [
    ("hidden_size", "big", "hidden_size is 'big'"), ("hidden_size", -32, "hidden_size is -32"),
    ("hidden_size", None, "hidden_size is None"), ("hidden_size", 32.5, "hidden_size is 32.5"),
    ("num_attention_heads", 3, "num_key_value_heads is 2, but must be a divisor of num_attention_heads (3)"),
    ("hidden_size+head_dim", (30, None), "hidden_size is 30, but must be a multiple of num_attention_heads (4)"),
    ("num_attention_heads", 0, "num_attention_heads is 0"),
    ("num_key_value_heads", 3, "num_key_value_heads is 3"), ("num_hidden_layers", True, "num_hidden_layers is True"),
    ("vocab_size", [96], "vocab_size is [96]"), ("intermediate_size", "48", "intermediate_size is '48'"),
    ("rms_norm_eps", None, "rms_norm_eps is None"), ("rms_norm_eps", -1e-6, "rms_norm_eps is -1e-06"),
    ("rope_theta", "1e4", "rope_theta is '1e4'"), ("rope_theta", 0, "rope_theta is 0"),
    ("max_position_embeddings", None, "max_position_embeddings is None"),
    ("head_dim", 0, "head_dim is 0"), ("hidden_act", 3, "hidden_act is 3"), ("hidden_act", "relu9", "hidden_act"),
    ("model_type", None, "model_type is None"), ("model_type", ["llama"], "model_type is ['llama']"),
    ("rope_scaling", "linear", "rope_scaling is 'linear'"),
    ("rope_scaling", {"rope_type": "linear"}, "rope_scaling.factor is None"),
    ("rope_scaling", {"rope_type": "linear", "factor": "2"}, "rope_scaling.factor is '2'"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                      "original_max_position_embeddings": 64}, "rope_scaling.high_freq_factor"),
    ("tie_word_embeddings", "yes", "tie_word_embeddings is 'yes'"),
    ("layer_types", ["full_attention"], "layer_types"),
    ("bos_token_id", "big", "bos_token_id is 'big'"), ("use_cache", 0, "use_cache is 0"),
]


def test_a_config_json_value_only_transformers_checks_is_one_line_too(inputs, tmp_path):  # noqa: F811
    """A field no family reads, which transformers' own config checks when the tokenizer is
    read beside it: one line naming the tokenizer's directory, never its traceback."""
    from cmoe_jax.loading.tokenizer import load_tokenizer

    d = _copy_with(inputs, tmp_path, "initializer_range", None)
    with pytest.raises(CmoeError) as e:
        load_tokenizer(d)
    assert str(e.value).startswith(f"cannot read the tokenizer in {d} (") and "\n" not in str(e.value)


def _copy_with(inputs, tmp_path, field, value):
    d = tmp_path / "dense"
    shutil.copytree(inputs["dense"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(zip(field.split("+"), value) if "+" in field else [(field, value)])
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("field,value,said", HF_CASES, ids=[f"{c[0]}={c[1]!r}"[:40] for c in HF_CASES])
def test_a_config_json_value_of_the_wrong_type_or_range_is_one_line(inputs, tmp_path, field, value, said):  # noqa: F811
    d = _copy_with(inputs, tmp_path, field, value)
    with pytest.raises(ConfigFieldError) as e:
        load_config(str(d))
    assert str(e.value).startswith(f"{d / 'config.json'}: ") and said in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("main,extra", [(eval_main, ["--seqlen", "16", "--max-windows", "1", "--no-progress"]),
                                        (generate_main, ["--prompt", "w1", "--max-new-tokens", "2"])])
def test_the_reported_hidden_size_big_is_an_error_line_not_a_traceback(inputs, tmp_path, capsys, main, extra):  # noqa: F811
    d = _copy_with(inputs, tmp_path, "hidden_size", "big")
    data = ["--data-path", str(inputs["text"])] if main is eval_main else []
    assert main(["--model", str(d), *data, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {d / 'config.json'}: hidden_size is 'big', but must be a whole number of at least 1: "
                   "fix that field, or use a complete, unedited copy of the model"], err


@pytest.mark.parametrize("field,value,said", [
    ("hidden_size", "big", "model_config.hidden_size is 'big'"), ("num_layers", -2, "model_config.num_layers is -2"),
    ("activation", "gelu9", "model_config.activation is 'gelu9'"), ("rms_norm_eps", None, "model_config.rms_norm_eps"),
    ("num_kv_heads", 3, "model_config.num_kv_heads is 3"), ("unknown_field", 1, "model_config.unknown_field"),
    ("tie_word_embeddings", "no", "model_config.tie_word_embeddings is 'no'"),
])
def test_an_unsealed_manifest_with_a_bad_config_value_is_one_line(inputs, tmp_path, field, value, said):  # noqa: F811
    """A directory written before manifests were sealed is still checked field by field."""
    d = tmp_path / "old"
    shutil.copytree(inputs["converted"], d)
    manifest = json.loads((d / MANIFEST).read_text())
    del manifest[SEAL]
    manifest["model_config"][field] = value
    (d / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConfigFieldError) as e:
        load_config(str(d))
    assert str(e.value).startswith(f"{d / MANIFEST}: ") and said in str(e.value), str(e.value)


def test_an_unsealed_manifest_with_a_bad_expert_spec_is_one_line(inputs, tmp_path):  # noqa: F811
    d = tmp_path / "old"
    shutil.copytree(inputs["converted"], d)
    manifest = json.loads((d / MANIFEST).read_text())
    del manifest[SEAL]
    spec = manifest["model_config"]["moe_layers"][0]
    spec["top_k"] = spec["num_experts"] + 1
    (d / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConfigFieldError, match=r"model_config.moe_layers\[0\].top_k is \d+, but must be at most"):
        load_config(str(d))


def _gguf(path, arch="llama", **fields):
    """A GGUF file holding metadata only: the shared fields of a tiny model, then `fields`
    ({key after the architecture: (writer method, value)}; value None: left out)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    base = {"block_count": ("add_uint32", 1), "context_length": ("add_uint32", 64),
            "embedding_length": ("add_uint32", 8), "feed_forward_length": ("add_uint32", 16),
            "attention.head_count": ("add_uint32", 2), "vocab_size": ("add_uint32", 8),
            "attention.layer_norm_rms_epsilon": ("add_float32", 1e-5)}
    for key, (method, value) in {**base, **fields}.items():
        if value is not None:
            getattr(w, method)(f"{arch}.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("key,written,said", [
    ("block_count", ("add_string", "two"), "GGUF metadata llama.block_count is 'two'"),
    ("embedding_length", ("add_int32", -8), "GGUF metadata llama.embedding_length is -8"),
    ("attention.head_count", ("add_float32", 2.5), "GGUF metadata llama.attention.head_count is 2.5"),
    ("attention.layer_norm_rms_epsilon", ("add_string", "small"), "layer_norm_rms_epsilon is 'small'"),
    ("rope.freq_base", ("add_float32", float("inf")), "GGUF metadata llama.rope.freq_base is inf"),
    ("feed_forward_length", ("add_uint32", None), "GGUF metadata llama.feed_forward_length is None"),
    ("vocab_size", ("add_uint32", None), "tokenizer.ggml.tokens is None"),
    ("attention.layer_norm_rms_epsilon", ("add_float32", None), "rms_norm_eps is None"),
])
def test_gguf_metadata_of_the_wrong_type_or_range_is_one_line(tmp_path, key, written, said):
    path = _gguf(tmp_path / "m.gguf", **{key: written})
    with pytest.raises(CmoeError) as e:
        load_config(str(path))
    assert str(e.value).startswith(f"{path}: ") and said in str(e.value), str(e.value)
    assert "\n" not in str(e.value)

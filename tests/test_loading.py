"""Checkpoint formats (sharded safetensors, .bin, GGUF) and loader errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import jax.numpy as jnp

from cmoe_jax.errors import CheckpointError, UnsupportedModelError
from cmoe_jax.loading import load_config, load_model
from tests.conftest import tiny_hf_model

TOKENS = np.random.default_rng(0).integers(0, 96, size=(2, 16))


def _ref_logits(model):
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


def _our_logits(path):
    return np.asarray(load_model(str(path), progress=False).model(jnp.asarray(TOKENS, jnp.int32)))


def test_sharded_safetensors(tmp_path):
    model = tiny_hf_model("llama")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    np.testing.assert_allclose(_our_logits(tmp_path), _ref_logits(model), atol=1e-4)


def test_pytorch_bin(tmp_path):
    model = tiny_hf_model("qwen2")
    (tmp_path / "config.json").write_text(model.config.to_json_string())
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    np.testing.assert_allclose(_our_logits(tmp_path), _ref_logits(model), atol=1e-4)


def _llama_cpp_rope_freqs(cfg) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as `rope_freqs` for Llama-3 scaling."""
    s = cfg.rope_parameters
    dim = cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (s["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    old, lo, hi, factor = (s["original_max_position_embeddings"], s["low_freq_factor"],
                           s["high_freq_factor"], s["factor"])
    out = []
    for wavelen in 2 * np.pi / freqs:
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def gguf_writer(cfg, path, arch: str):
    """A `gguf.GGUFWriter` holding the hyper-parameters llama.cpp's converter writes for every
    decoder (`TextModel.set_gguf_parameters`) of the transformers config `cfg`."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    return w


def close_gguf(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_llama_gguf(model, path, rope: str | None = None):
    """Write a llama GGUF the way llama.cpp's converter does (Q/K rows permuted); `rope`
    "llama3" adds the `rope_freqs` tensor, "linear" the rope.scaling keys."""
    import gguf

    cfg = model.config
    w = gguf_writer(cfg, path, "llama")
    if rope == "llama3":
        w.add_tensor("rope_freqs.weight", _llama_cpp_rope_freqs(cfg))
    elif rope == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_parameters["factor"])

    def permute(t, n_head):
        return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for name, t in model.state_dict().items():
        t = t.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", t)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", t)
        elif name == "lm_head.weight":
            w.add_tensor("output.weight", t)
        else:
            _, _, i, rest = name.split(".", 3)
            mod = rest.rsplit(".", 1)[0]
            if mod == "self_attn.q_proj":
                t = permute(t, cfg.num_attention_heads)
            if mod == "self_attn.k_proj":
                t = permute(t, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{names[mod]}.weight", t)
    close_gguf(w)


def test_gguf_unpermutes_qk(tmp_path):
    model = tiny_hf_model("llama")
    _write_llama_gguf(model, tmp_path / "tiny.gguf")
    np.testing.assert_allclose(_our_logits(tmp_path / "tiny.gguf"), _ref_logits(model), atol=1e-4)


@pytest.mark.parametrize("family,overrides", [
    ("llama3", {}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
])
def test_gguf_rope_scaling_matches_the_source_model(tmp_path, family, overrides):
    """A GGUF carrying RoPE scaling (Llama-3 `rope_freqs` / linear keys) loads to the logits of
    the transformers model it was written from. (transformers itself ignores these GGUF keys
    for llama files, so the reference is the source checkpoint, not transformers reading the GGUF.)"""
    model = tiny_hf_model(family, **overrides)
    rope = "llama3" if family == "llama3" else "linear"
    _write_llama_gguf(model, tmp_path / "scaled.gguf", rope=rope)
    _write_llama_gguf(model, tmp_path / "plain.gguf")
    tokens = np.random.default_rng(1).integers(0, 96, size=(1, 120))
    with torch.no_grad():
        expected = model(torch.tensor(tokens)).logits.numpy()
    lm = load_model(str(tmp_path / "scaled.gguf"), progress=False)
    assert dict(lm.config.rope_scaling)["rope_type"] in ("freq_factors", "linear")
    ours = np.asarray(lm.model(jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_allclose(ours, expected, atol=1e-4)
    unscaled = np.asarray(load_model(str(tmp_path / "plain.gguf"), progress=False).model(
        jnp.asarray(tokens, jnp.int32)))
    # the scaling is visible at these positions: ignoring it misses the tolerance by far
    assert np.abs(unscaled - expected).max() > 10 * max(np.abs(ours - expected).max(), 1e-4)


def test_gguf_unsupported_rope_scaling_is_one_line_error(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "yarn.gguf"), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, 8),
                       (w.add_feed_forward_length, 16), (w.add_head_count, 2), (w.add_vocab_size, 8)):
        add(value)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="RoPE scaling 'yarn' is not supported"):
        load_config(str(tmp_path / "yarn.gguf"))


def test_missing_path_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(str(tmp_path / "nope"))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(UnsupportedModelError, match="unsupported model_type 'gpt2'"):
        load_config(str(tmp_path))


def test_truncated_safetensors(tmp_path):
    model = tiny_hf_model("llama")
    model.save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        load_model(str(tmp_path), progress=False)


def test_corrupted_safetensors_header(tmp_path):
    model = tiny_hf_model("llama")
    model.save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:24] = b"\xff" * 16
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        load_model(str(tmp_path), progress=False)


def test_config_weight_mismatch_names_tensor(tmp_path):
    model = tiny_hf_model("llama")
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape"):
        load_model(str(tmp_path), progress=False)


def test_missing_tensor_named(tmp_path):
    model = tiny_hf_model("llama")
    (tmp_path / "config.json").write_text(model.config.to_json_string())
    sd = {k: v for k, v in model.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        load_model(str(tmp_path), progress=False)


def test_directory_without_weights(tmp_path):
    model = tiny_hf_model("llama")
    (tmp_path / "config.json").write_text(model.config.to_json_string())
    with pytest.raises(CheckpointError, match="no weights found"):
        load_model(str(tmp_path), progress=False)

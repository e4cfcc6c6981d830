"""Shared fixtures: tiny random `transformers` checkpoints written to disk."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drop every compiled executable after each test module. XLA's CPU backend maps each
    executable's machine code into its own memory regions; a serial run of the whole suite
    in one process otherwise climbs past the kernel's per-process mapping limit
    (vm.max_map_count, 65530 by default) and the next compile segfaults."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a child process with `devices` CPU devices, keeping the suite's other
    XLA flags (scripts/test_env.sh turns off XLA's backend optimisation for compile time)."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])


def tiny_hf_model(family: str, **overrides):
    """A tiny random `transformers` causal LM of one family (torch, fp32, eval mode)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    common.update(overrides)
    if family == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif family == "llama3":
        common.setdefault("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        common["rope_theta"] = 500000.0
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif family == "llama_tied":
        cfg, cls = tf.LlamaConfig(tie_word_embeddings=True, **common), tf.LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg, cls = tf.Qwen3Config(head_dim=16, **common), tf.Qwen3ForCausalLM
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**{**dict(head_dim=8, moe_intermediate_size=16, num_experts=4,
                                          num_experts_per_tok=2, norm_topk_prob=False), **common})
        cls = tf.Qwen3MoeForCausalLM
    elif family == "qwen3_moe_norm":
        cfg = tf.Qwen3MoeConfig(head_dim=8, moe_intermediate_size=16, num_experts=4,
                                num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0], **common)
        cls = tf.Qwen3MoeForCausalLM
    elif family == "mixtral":
        cfg = tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
        cls = tf.MixtralForCausalLM
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(num_experts=8, num_experts_per_tok=3, **common)
        cls = tf.OlmoeForCausalLM
    elif family == "qwen2_moe":  # layer 0 dense; a shared expert with a sigmoid gate
        cfg = tf.Qwen2MoeConfig(**{**dict(moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                          num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                                          mlp_only_layers=[0]), **common})
        cls = tf.Qwen2MoeForCausalLM
    elif family == "mistral":  # a window shorter than the test sequences
        common.setdefault("sliding_window", 7)
        cfg, cls = tf.MistralConfig(**common), tf.MistralForCausalLM
    elif family == "phi3":  # fused qkv_proj and gate_up_proj; a window shorter than the tests
        common.setdefault("sliding_window", 9)
        cfg = tf.Phi3Config(pad_token_id=0, bos_token_id=1, eos_token_id=2, **common)
        cls = tf.Phi3ForCausalLM
    elif family == "gemma3_text":  # local, local, global layers; windows shorter than the tests
        common.update(num_hidden_layers=overrides.get("num_hidden_layers", 3))
        common.setdefault("sliding_window", 6)
        common.setdefault("layer_types", ["sliding_attention", "sliding_attention", "full_attention"]
                          [:common["num_hidden_layers"]])
        common.setdefault("rope_parameters", {
            "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})
        cfg = tf.Gemma3TextConfig(head_dim=16, query_pre_attn_scalar=12, **common)
        cls = tf.Gemma3ForCausalLM
    else:
        raise ValueError(family)
    model = cls(cfg).eval()
    with torch.no_grad():  # random norms and biases, so every weight is exercised
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture
def save_tiny(tmp_path):
    def _save(family: str, subdir: str = "model", **kw):
        model = tiny_hf_model(family, **kw)
        path = tmp_path / subdir
        model.save_pretrained(path, **({} if "safe" not in kw else {}))
        return model, path
    return _save


WORDS = [f"w{i}" for i in range(90)]


def save_tiny_tokenizer(path):
    """A word-level tokenizer over WORDS (ids 0..91), loadable with AutoTokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[BOS]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]").save_pretrained(str(path))


def write_random_text(path, n_words: int, seed: int = 0):
    """A text file of random WORDS, one short line per 12 words."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = [WORDS[i] for i in rng.integers(0, len(WORDS), n_words)]
    lines = [" ".join(words[i:i + 12]) for i in range(0, n_words, 12)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """A tiny random Llama checkpoint with a tokenizer, plus a calibration text file."""
    model = tiny_hf_model("llama", intermediate_size=64)
    path = tmp_path / "tiny_llama"
    model.save_pretrained(path)
    save_tiny_tokenizer(path)
    text = write_random_text(tmp_path / "calib.txt", 4000)
    return model, path, text


def dense_and_converted(cfg, plan: str):
    """A tiny random dense `Decoder` of `cfg` and its CMoE conversion under `plan` (4 random
    calibration windows of 32 tokens)."""
    import numpy as np
    from flax import nnx

    from cmoe_jax.methods.cmoe import MoEPlan
    from cmoe_jax.convert import ConvertConfig, convert_model
    from cmoe_jax.models import Decoder

    dense = Decoder(cfg, rngs=nnx.Rngs(0))
    calib = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(4, 32)).astype(np.int32)
    moe, _ = convert_model(dense, calib, ConvertConfig(plan=MoEPlan.parse(plan), k_act=4),
                           progress=False)
    return dense, moe

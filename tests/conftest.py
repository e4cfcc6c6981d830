"""Shared fixtures: tiny random `transformers` checkpoints written to disk."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
        cfg = tf.Qwen3MoeConfig(head_dim=8, moe_intermediate_size=16, num_experts=4,
                                num_experts_per_tok=2, norm_topk_prob=False, **common)
        cls = tf.Qwen3MoeForCausalLM
    elif family == "qwen3_moe_norm":
        cfg = tf.Qwen3MoeConfig(head_dim=8, moe_intermediate_size=16, num_experts=4,
                                num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0], **common)
        cls = tf.Qwen3MoeForCausalLM
    elif family == "mixtral":
        cfg = tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
        cls = tf.MixtralForCausalLM
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

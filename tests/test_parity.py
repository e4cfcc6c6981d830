"""Logits of cmoe_jax decoders against `transformers` (torch) on the same weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import jax.numpy as jnp

from cmoe_jax.loading import load_model

DENSE = ["llama", "llama3", "llama_tied", "qwen2", "qwen3", "mistral", "gemma3_text", "phi3"]
SPARSE = ["qwen3_moe", "qwen3_moe_norm", "mixtral", "olmoe", "qwen2_moe"]


def _compare(hf_model, path, seq_len=40, batch=3, tol=1e-4):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, hf_model.config.vocab_size, size=(batch, seq_len))
    with torch.no_grad():
        ref = hf_model(torch.tensor(tokens)).logits.numpy()
    lm = load_model(str(path), progress=False)
    ours = np.asarray(lm.model(jnp.asarray(tokens, jnp.int32)))
    err = np.abs(ours - ref).max()
    assert err <= tol, f"max abs logits difference {err}"


@pytest.mark.parametrize("family", DENSE + SPARSE)
def test_logits_match_transformers(save_tiny, family):
    model, path = save_tiny(family)
    _compare(model, path)


def test_llama3_rope_scaling_long_positions(save_tiny):
    # positions beyond original_max_position_embeddings exercise every frequency band
    model, path = save_tiny("llama3", max_position_embeddings=512)
    _compare(model, path, seq_len=200, batch=1)


def test_bf16_close_to_fp32(save_tiny):
    model, path = save_tiny("qwen3")
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 96, (2, 24)), jnp.int32)
    fp32 = np.asarray(load_model(str(path), progress=False).model(tokens))
    bf16_model = load_model(str(path), dtype=jnp.bfloat16, progress=False).model
    bf16 = np.asarray(bf16_model(tokens).astype(jnp.float32))
    assert bf16_model.embed[...].dtype == jnp.bfloat16
    assert np.abs(bf16 - fp32).max() < 0.05 * np.abs(fp32).max() + 0.05


def test_ffn_inputs_are_exposed(save_tiny):
    model, path = save_tiny("llama")
    lm = load_model(str(path), progress=False)
    tokens = jnp.zeros((1, 8), jnp.int32)
    logits, captured = lm.model(tokens, capture_ffn_inputs=True)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(lm.model(tokens)))
    assert len(captured) == 2 and captured[0].shape == (1, 8, 32)
    # same as transformers' post-attention-layernorm input to the MLP
    seen = []
    hook = model.model.layers[1].mlp.register_forward_hook(lambda m, a, o: seen.append(a[0]))
    with torch.no_grad():
        model(torch.zeros((1, 8), dtype=torch.long))
    hook.remove()
    np.testing.assert_allclose(np.asarray(captured[1]), seen[0].numpy(), atol=1e-5)


def test_token_nll_matches_transformers_loss(save_tiny):
    model, path = save_tiny("llama")
    tokens = np.random.default_rng(3).integers(0, 96, size=(2, 37))
    with torch.no_grad():
        ref = model(torch.tensor(tokens), labels=torch.tensor(tokens)).loss.item()
    lm = load_model(str(path), progress=False)
    nll = np.asarray(lm.model.token_nll(jnp.asarray(tokens, jnp.int32), chunk=16))
    assert nll.shape == (2, 36)
    assert abs(nll.mean() - ref) < 1e-5


@pytest.mark.parametrize("t", [1, 128, 300])
def test_causal_attention_matches_jax_reference(t):
    """Blocked attention (bias mask, denominator through the ones column) against
    `jax.nn.dot_product_attention`: outputs and gradients, GQA, partial last block."""
    import jax

    from cmoe_jax.models.layers import causal_attention

    rng = np.random.default_rng(t)
    q, k, v = (jnp.asarray(rng.standard_normal((2, t, n, 16)) * 3, jnp.float32) for n in (6, 2, 2))
    ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(causal_attention(q, k, v), ref(q, k, v), atol=1e-4, rtol=1e-4)
    w = jnp.asarray(rng.standard_normal((2, t, 6, 16)), jnp.float32)
    grads = jax.grad(lambda *a: (causal_attention(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    grads_ref = jax.grad(lambda *a: (ref(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    for g, gr in zip(grads, grads_ref):
        np.testing.assert_allclose(g, gr, atol=1e-4, rtol=1e-4)

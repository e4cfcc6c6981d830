"""The KV-cache generation against independent references: transformers' `generate` for dense
models, and the uncached forward's argmax at every step for converted and MoE models."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from cmoe_jax.generate import Decoding, generate
from cmoe_jax.loading import load_model
from cmoe_jax.models.kv_cache import KVCache
from tests.conftest import dense_and_converted, tiny_hf_model

PROMPT_LENGTHS = (5, 9, 1, 13, 7, 3)


def _prompts(vocab=96, lengths=PROMPT_LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def _hf_greedy(hf, prompts, new_tokens):
    """transformers' greedy `generate` on the left-padded batch (no early stop)."""
    import torch

    hf.generation_config.eos_token_id = None
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):], mask[r, width - len(p):] = torch.tensor(p), 1
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                      do_sample=False, pad_token_id=0)
    return out[:, width:].tolist()


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3", "llama_tied", "mistral",
                                    "gemma3_text", "olmoe", "qwen2_moe", "phi3"])
def test_greedy_equals_transformers_generate(family, tmp_path):
    hf = tiny_hf_model(family)
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), progress=False).model
    prompts = _prompts()
    ours = generate(model, prompts, Decoding(32, batch_size=8))
    assert ours == _hf_greedy(hf, prompts, 32)


def test_cache_growth_and_small_batches_give_the_same_tokens(tmp_path):
    """A generation longer than the first cache (it doubles mid-way), in batches of 2 and
    of 1, equals transformers' in one batch."""
    hf = tiny_hf_model("llama", max_position_embeddings=256)
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), progress=False).model
    prompts = _prompts(lengths=(140, 3, 11, 20))  # 140: a prefill of two query blocks
    expected = _hf_greedy(hf, prompts, 60)
    assert generate(model, prompts, Decoding(60, batch_size=2)) == expected
    assert generate(model, prompts[:1], Decoding(60, batch_size=1)) == expected[:1]


def _assert_uncached_argmax(model, prompts, outputs):
    """Each generated token is the argmax of the plain forward over the prompt and the
    tokens before it (each row on its own, no padding)."""
    for prompt, out in zip(prompts, outputs):
        seq = jnp.asarray([prompt + out[:-1]], jnp.int32)
        logits = np.asarray(model(seq))[0, len(prompt) - 1:]
        np.testing.assert_array_equal(logits.argmax(-1), out)


def _converted(kind, tmp_path):
    if kind in ("qwen3_moe", "mixtral"):
        tiny_hf_model(kind).save_pretrained(tmp_path)
        return load_model(str(tmp_path), progress=False).model
    if kind == "hierarchical":
        from cmoe_jax.methods.cmoe import MoEPlan
        from cmoe_jax.convert import ConvertConfig
        from cmoe_jax.methods.hierarchical.convert import convert_moe_model

        tiny_hf_model("qwen3_moe").save_pretrained(tmp_path)
        source = load_model(str(tmp_path), progress=False).model
        calib = np.random.default_rng(0).integers(0, 96, (4, 32)).astype(np.int32)
        return convert_moe_model(source, calib, ConvertConfig(plan=MoEPlan(1, 1, 4), k_act=4, router_neurons=2),
                                 progress=False)[0]
    if kind == "conmoe":
        from cmoe_jax.methods.conmoe import apply_plans, collect_stats, conmoe_plans

        tiny_hf_model("qwen3_moe", num_hidden_layers=4).save_pretrained(tmp_path)
        source = load_model(str(tmp_path), progress=False).model
        calib = np.random.default_rng(0).integers(0, 96, (2, 32)).astype(np.int32)
        plans, _ = conmoe_plans(source, collect_stats(source, calib, progress=False), 0.5, 2, "adaptive")
        return apply_plans(source, plans)
    from cmoe_jax.loading import load_config

    tiny_hf_model("llama", intermediate_size=64).save_pretrained(tmp_path)
    cfg, _ = load_config(str(tmp_path))
    return dense_and_converted(cfg, kind)[1]


@pytest.mark.parametrize("kind", ["S1A1E4", "S2A2E8", "qwen3_moe", "mixtral", "hierarchical", "conmoe"])
def test_cached_decode_equals_uncached_argmax(kind, tmp_path):
    model = _converted(kind, tmp_path)
    prompts = _prompts(vocab=model.config.vocab_size, lengths=(6, 11, 2))
    outputs = generate(model, prompts, Decoding(16, batch_size=4))
    assert all(len(o) == 16 for o in outputs)
    _assert_uncached_argmax(model, prompts, outputs)


@pytest.mark.parametrize("batch, kv_heads", [(1, 1), (1, 2), (2, 1)])
def test_per_layer_cache_holds_what_the_stacked_one_holds(batch, kv_heads, tmp_path):
    """An unrolled model's per-layer cache (its default) and one `[L, ...]` array give the
    same hidden states and hold the same keys and values, through a prefill, a growth and
    a decode step; a stacked model keeps the `[L, ...]` layout. A per-layer cache of more
    than one row or kv head is written before it is read (`KVCache.in_place`), the stacked
    one never is."""
    tiny_hf_model("llama", num_key_value_heads=kv_heads).save_pretrained(tmp_path)
    stacked = load_model(str(tmp_path), progress=False).model
    model = stacked.unstacked()
    assert model.empty_cache(2, 8).per_layer and not stacked.empty_cache(2, 8).per_layer
    kv_rows = batch * model.config.num_kv_heads
    assert model.empty_cache(batch, 8).in_place == (kv_rows > 1) and not stacked.empty_cache(2, 8).in_place
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (batch, 6)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6), (batch, 6))
    runs = []
    for per_layer in (True, False):
        cache = KVCache.empty(model.config, batch, 8, jnp.float32, per_layer=per_layer)
        h, cache = model.run_cached(tokens, positions, cache.mark(jnp.ones((batch, 6), bool), 0), 0)
        cache = cache.grow(16).mark(jnp.ones((batch, 1), bool), 6)
        h2, cache = model.run_cached(tokens[:, :1], jnp.full((batch, 1), 6), cache, 6)
        runs.append((h, h2, *(np.stack(x).reshape(model.config.num_layers, batch, -1) for x in (cache.k, cache.v))))
    for got, want in zip(*runs):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch", [1, 4])
def test_decode_step_copies_no_cache_and_no_embedding(batch, tmp_path):
    """A decode step reads each layer's cache and the tied embedding where they lie: no copy
    or transpose of either in the compiled step of a scanned model; one whose layers run
    on their own copies none unless it decodes one row with one kv head (`KVCache.in_place`)."""
    from benchmarks.decode_step import compiled_step, whole_copies

    tiny_hf_model("llama_tied").save_pretrained(tmp_path)
    stacked = load_model(str(tmp_path), progress=False).model
    cfg = stacked.config
    assert cfg.tie_word_embeddings
    copies = {name: whole_copies(m, compiled_step(m, batch, 64)[1], batch, 64)
              for name, m in (("scanned", stacked), ("unrolled", stacked.unstacked()))}
    assert copies["scanned"] == []
    table = (f"[{cfg.vocab_size},{cfg.hidden_size}]", f"[{cfg.hidden_size},{cfg.vocab_size}]")
    assert not [c for c in copies["unrolled"] if c.endswith(table)]
    assert cfg.num_kv_heads > 1 and copies["unrolled"] == []

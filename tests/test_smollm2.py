"""The embedded SmolLM2-135M-Instruct (GGUF) against transformers reading the same file."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import jax.numpy as jnp

from cmoe_jax.loading import load_model, smollm2_gguf

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "test.txt"


@pytest.mark.slow
def test_smollm2_logits_match_transformers_on_512_real_tokens():
    import transformers

    if TEXT.exists():
        text = TEXT.read_text()[:6000]
    else:  # outside this project's machines: any real English text will do
        text = Path(transformers.__file__).with_name("__init__.py").read_text()[:6000]
    lm = load_model("smollm2", progress=False)
    ids = lm.tokenizer.encode(text)[:512]
    assert len(ids) == 512
    path = smollm2_gguf()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32).eval()
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert ref_tok(text, add_special_tokens=False)["input_ids"][:512] == ids
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits.numpy()
    ours = np.asarray(lm.model(jnp.asarray([ids], jnp.int32)))
    assert np.abs(ours - expected).max() <= 1e-3

"""The family units: what an unsupported checkpoint is told, and the per-family switches that
parity tests cannot see from outside (evaluation windows, the activation names)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from cmoe_jax.data import text_windows
from cmoe_jax.errors import UnsupportedModelError
from cmoe_jax.loading import load_config
from cmoe_jax.models import ModelConfig
from cmoe_jax.models.families import FAMILIES, GUIDE


def test_unsupported_model_type_names_the_families_and_the_guide(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    with pytest.raises(UnsupportedModelError) as e:
        load_config(str(tmp_path))
    message = str(e.value)
    assert "'deepseek_v3'" in message and GUIDE in message
    assert all(name in message for name in FAMILIES)


def test_multimodal_gemma3_is_refused_in_one_line():
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_hf({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}})
    assert "\n" not in str(e.value) and "gemma3_text" in str(e.value)


def test_every_window_opens_with_bos_when_asked():
    tokens = np.arange(100, 130)
    plain = text_windows(tokens, 8)
    with_bos = text_windows(tokens, 8, bos=2)
    assert plain.shape == (3, 8) and with_bos.shape == (4, 8)
    assert (with_bos[:, 0] == 2).all()
    # the text continues window to window, nothing skipped or repeated
    np.testing.assert_array_equal(with_bos[:, 1:].reshape(-1), tokens[:28])
    np.testing.assert_array_equal(plain.reshape(-1), tokens[:24])


@pytest.mark.parametrize("name", ["silu", "gelu_tanh", "gelu"])
def test_activations_match_torch(name):
    import jax.numpy as jnp
    import torch
    from transformers.activations import ACT2FN

    from cmoe_jax.moe.activations import glu_activation, to_hf_name

    x = np.linspace(-6, 6, 101, dtype=np.float32)
    ref = ACT2FN[to_hf_name(name)](torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.asarray(glu_activation(name)(jnp.asarray(x))), ref, atol=1e-6)


def test_mistral_without_a_window_exports_none_not_the_transformers_default():
    import transformers

    from cmoe_jax.export.hf_config import hf_config

    cfg = ModelConfig.from_hf({"model_type": "mistral", "vocab_size": 96, "hidden_size": 32,
                               "intermediate_size": 48, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2,
                               "sliding_window": None})
    assert cfg.sliding_window == 0 and cfg.window(1) == 0
    out = hf_config(cfg)
    assert out["sliding_window"] is None and out["architectures"] == ["MistralForCausalLM"]
    assert transformers.MistralConfig(**out).sliding_window is None

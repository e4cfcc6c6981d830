"""GGUF files of the MoE families as llama.cpp's converter writes them (OLMoE as "olmoe",
Qwen2-MoE as "qwen2moe", Qwen3-MoE as "qwen3moe", Mixtral as "llama" with expert tensors):
experts stacked per layer, names from the `gguf` package's own tensor map, Q/K rows permuted
for "llama" only. Loaded with `load_model`, they give the logits of the transformers model
they were written from; where transformers reads the architecture from GGUF itself, its
model of the same file is a second reference."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

import jax.numpy as jnp

from cmoe_jax.loading import load_model
from tests.conftest import tiny_hf_model
from tests.test_loading import close_gguf, gguf_writer

TOKENS = np.random.default_rng(3).integers(0, 96, size=(2, 20))
# family -> (llama.cpp arch, the tiny model's overrides llama.cpp's semantics need: every
# layer MoE, top-k gates renormalised for qwen3moe as llama.cpp always does)
ARCHS = {"olmoe": ("olmoe", {}), "qwen2_moe": ("qwen2moe", {"mlp_only_layers": []}),
         "qwen3_moe": ("qwen3moe", {"norm_topk_prob": True}), "mixtral": ("llama", {})}


def _permute(t: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: each head's rotate-half rows interleaved."""
    return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def _tensors(model, permute: bool):
    """(transformers module name, suffix, [out, in] array) in the converter's layout: experts
    stacked [E, out, in] per projection, Q/K permuted for llama."""
    cfg = model.config
    for name, t in model.state_dict().items():
        t = t.numpy().astype(np.float32)
        if name.endswith("experts.gate_up_proj"):  # transformers 5 fuses gate and up in memory
            half = t.shape[1] // 2
            yield name.replace("gate_up_proj", "gate_proj"), "weight", t[:, :half]
            yield name.replace("gate_up_proj", "up_proj"), "weight", t[:, half:]
        elif name.endswith("experts.down_proj"):
            yield name, "weight", t
        else:
            if permute and name.endswith("q_proj.weight"):
                t = _permute(t, cfg.num_attention_heads)
            if permute and name.endswith("k_proj.weight"):
                t = _permute(t, cfg.num_key_value_heads)
            module, suffix = name.rsplit(".", 1)
            yield module, suffix, t


def write_moe_gguf(model, arch: str, path, gate_1d: bool = False, q8_experts: bool = False):
    """`gate_1d`: Qwen2-MoE's shared-expert gate written [d], as converters that squeezed
    every tensor did (and transformers' GGUF reader expects), not [1, d] as llama.cpp's
    converter writes it now. `q8_experts`: the stacked expert tensors whose rows fill Q8_0
    blocks (32 values) quantized, as a quantized MoE file holds them."""
    cfg = model.config
    w = gguf_writer(cfg, path, arch)
    w.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):  # Qwen2MoeModel.set_gguf_parameters (Qwen3-MoE inherits)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if getattr(cfg, "head_dim", None) and arch == "qwen3moe":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)
    for module, suffix, t in _tensors(model, permute=arch == "llama"):
        gguf_name = names.get_name(module)
        assert gguf_name is not None, module
        if gate_1d and gguf_name.endswith("ffn_gate_inp_shexp"):
            t = t.reshape(-1)
        if q8_experts and gguf_name.endswith("_exps") and t.shape[-1] % 32 == 0:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(f"{gguf_name}.{suffix}", gguf.quants.quantize(t, q8), raw_dtype=q8)
            continue
        w.add_tensor(f"{gguf_name}.{suffix}", t)
    close_gguf(w)


def _ours(path):
    lm = load_model(str(path), progress=False)
    return lm, np.asarray(lm.model(jnp.asarray(TOKENS, jnp.int32)))


def _logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


@pytest.mark.parametrize("family", list(ARCHS))
def test_moe_gguf_loads_to_the_source_logits(tmp_path, family):
    arch, overrides = ARCHS[family]
    model = tiny_hf_model(family, **overrides)
    write_moe_gguf(model, arch, tmp_path / "tiny.gguf")
    lm, ours = _ours(tmp_path / "tiny.gguf")
    assert lm.config.model_type == family
    assert all(s is not None for s in lm.config.moe_layers)
    np.testing.assert_allclose(ours, _logits(model), atol=1e-4)


@pytest.mark.parametrize("family,q8", [("qwen2_moe", False), ("qwen3_moe", False), ("qwen3_moe", True)])
def test_transformers_reads_the_same_gguf_alike(tmp_path, family, q8):
    """transformers' own GGUF reader (its qwen2moe / qwen3moe support; it has none for olmoe
    and reads a "llama" file with experts as a dense Llama) on the same file, Q8_0 experts
    included. It takes no expert widths from GGUF metadata, so the shapes come from the
    source config; every weight comes from the file (the shared-expert gate written [d], the
    layout that reader takes)."""
    arch, overrides = ARCHS[family]
    model = tiny_hf_model(family, **overrides)
    write_moe_gguf(model, arch, tmp_path / "tiny.gguf", gate_1d=True, q8_experts=q8)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="tiny.gguf", config=model.config, dtype=torch.float32).eval()
    _, ours = _ours(tmp_path / "tiny.gguf")
    np.testing.assert_allclose(ours, _logits(ref), atol=1e-4)
    if q8:  # the quantization is visible: the source model's logits are much further away
        assert np.abs(ours - _logits(model)).max() > 10 * np.abs(ours - _logits(ref)).max()

"""CMoE conversion layer by layer against a torch mirror of the authors' pipeline
(`benchmarks/cmoe_authors_reference.py`): the `transformers` layers with their own norms,
attention types and rotary embeddings, only the MLP replaced. Given the same partition, every
layer's FFN input seen during conversion and the converted model's logits must agree; on a
sandwich-norm family (Gemma 3) this pins the post-feed-forward norm in the calibration pass."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import cmoe_authors_reference as authors  # noqa: E402
from cmoe_jax.convert import ConvertConfig, convert_model  # noqa: E402
from cmoe_jax.loading import load_model  # noqa: E402
from cmoe_jax.methods.cmoe import MoEPlan  # noqa: E402
from cmoe_jax.methods.cmoe import convert as cmoe_convert  # noqa: E402
from tests.conftest import tiny_hf_model  # noqa: E402


@pytest.mark.parametrize("family", ["gemma3_text", "llama"])
def test_conversion_equals_the_authors_pipeline_layer_by_layer(tmp_path, monkeypatch, family):
    hf = tiny_hf_model(family, num_hidden_layers=3, intermediate_size=64)
    with torch.no_grad():  # norms away from their initial values, so each one matters
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), progress=False)
    calib = np.random.default_rng(0).integers(0, 96, (4, 24)).astype(np.int32)
    cc = ConvertConfig(plan=MoEPlan.parse("S2A2E8"), k_act=4, kmeans_iters=1,
                       **ConvertConfig.PAPER_ROUTER)
    seen, carve = [], cmoe_convert.carve_one_layer

    def recording(layer, x, cc, plan):
        seen.append(np.asarray(x))
        return carve(layer, x, cc, plan)

    monkeypatch.setattr(cmoe_convert, "carve_one_layer", recording)
    moe, records = convert_model(lm.model, calib, cc, progress=False)

    def ours(i, markers, rates):
        c = records[i].carving
        return authors.Carving(c.shared_idx, c.expert_idx, c.representative_idx[:, 0])

    mirror = authors.convert(hf, calib, shared=2, active=2, total=8, k_act=4, carve=ours)
    assert len(seen) == len(mirror) == 3
    for i, layer in enumerate(mirror):
        x = layer["ffn_input"]
        err, scale = np.abs(seen[i] - x).max(), np.abs(x).max()
        assert err <= 1e-4 * scale, f"layer {i}: FFN input differs by {err} (scale {scale})"
    with torch.no_grad():
        expected = hf(torch.as_tensor(calib, dtype=torch.long)).logits.numpy()
    got = np.asarray(moe(jnp.asarray(calib)))
    assert np.abs(got - expected).max() <= 1e-3 * np.abs(expected).max()


def test_authors_carving_is_a_balanced_partition_with_the_top_rates_shared():
    rng = np.random.default_rng(1)
    markers = torch.from_numpy((rng.random((200, 64)) < 0.1).astype(np.float32))
    rates = markers.mean(0)
    c = authors.authors_carving(markers, rates, shared=2, total=8)
    ids = np.sort(np.concatenate([c.shared, c.experts.ravel()]))
    np.testing.assert_array_equal(ids, np.arange(64))
    assert c.experts.shape == (6, 8) and len(c.shared) == 16
    assert rates[c.shared].min() >= np.delete(rates.numpy(), c.shared).max()
    for e, r in zip(c.experts, c.representatives):
        assert r in e


@pytest.mark.parametrize("family", ["gemma3_text", "llama"])
def test_authors_mirror_with_every_expert_active_is_the_dense_model(family):
    """The mirror's own carving with all routed experts active (S1A7E8) computes the dense
    model: the adaptation changes where neurons go, never what the layer computes."""
    hf = tiny_hf_model(family, num_hidden_layers=3, intermediate_size=64)
    calib = np.random.default_rng(2).integers(0, 96, (4, 24))
    tokens = torch.as_tensor(calib, dtype=torch.long)
    with torch.no_grad():
        dense = hf(tokens).logits.numpy()
        authors.convert(hf, calib, shared=1, active=7, total=8, k_act=4)
        moe = hf(tokens).logits.numpy()
    assert all(isinstance(layer.mlp, authors.AuthorsMoE) for layer in hf.model.layers)
    np.testing.assert_allclose(moe, dense, atol=1e-4 * np.abs(dense).max())

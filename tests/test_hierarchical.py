"""Hierarchical CMoE on tiny random Qwen3-MoE and Mixtral checkpoints: parity with every
sub-expert active, the flattened dispatch against a per-expert loop, FLOPs, balancing,
resume, 8 devices, the CLI and LoRA fine-tuning of the result."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cmoe_jax.carving import MoEPlan
from cmoe_jax.convert import ConvertConfig
from cmoe_jax.convert.cli import main as convert_main
from cmoe_jax.convert.hierarchical import convert_moe_model
from cmoe_jax.loading import load_model
from cmoe_jax.moe.hierarchical import HierMoEFFN, flops_per_token

ROOT = Path(__file__).resolve().parents[1]


def _calib(n=4, t=32, vocab=96, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=(n, t)).astype(np.int32)


@pytest.fixture(params=["qwen3_moe", "qwen3_moe_norm", "mixtral"])
def moe_source(request, save_tiny):
    kw = {"intermediate_size": 32} if request.param == "mixtral" else {}
    hf, path = save_tiny(request.param, **kw)
    return hf, load_model(str(path), progress=False).model


def _hf_logits(hf, tokens):
    import torch

    with torch.no_grad():
        return hf(torch.as_tensor(np.array(tokens), dtype=torch.long)).logits.numpy()


def test_every_sub_expert_active_equals_the_source(moe_source):
    hf, model = moe_source
    d_e = next(s for s in model.config.moe_layers if s is not None).expert_width
    plan = MoEPlan(1, 3, 4)  # all N'_r = 3 routed sub-experts active
    hier, records = convert_moe_model(model, _calib(), ConvertConfig(plan=plan, k_act=4, router_neurons=2),
                                       progress=False)
    tokens = jnp.asarray(_calib(2, 24, seed=5))
    np.testing.assert_allclose(np.asarray(hier(tokens)), _hf_logits(hf, tokens), atol=1e-4)
    for r, spec in zip(records, hier.config.moe_layers):
        if spec is None:
            continue
        assert spec.sub_experts == 4 and spec.expert_width == d_e // 4
        for e in r.experts:  # each expert's carving is a partition of its neurons
            ids = np.concatenate([e.carving.shared_idx, e.carving.expert_idx.ravel()])
            assert sorted(ids.tolist()) == list(range(d_e))


def _loop_reference(layer: HierMoEFFN, x):
    """Eq. 10 token by token, expert by expert (numpy), from the layer's own weights."""
    x = np.asarray(x, np.float64)
    ids, w = (np.asarray(a) for a in layer.top_route(jnp.asarray(x, jnp.float32)))
    p = {k: np.asarray(getattr(layer, k)[...], np.float64)
         for k in ("expert_gate", "expert_up", "expert_down", "sub_gate", "sub_up", "u", "router_bias")}
    n_sub, n_s, r = layer.sub_experts, layer.sub_shared, layer.sub_router_neurons
    silu = lambda a: a / (1 + np.exp(-a))
    expert = lambda e, v: (silu(v @ p["expert_gate"][e]) * (v @ p["expert_up"][e])) @ p["expert_down"][e]
    out = np.zeros_like(x)
    for t, v in enumerate(x):
        for i, wi in zip(ids[t], w[t]):
            s = np.abs(silu(v @ p["sub_gate"][i]) * (v @ p["sub_up"][i])).reshape(-1, r).sum(-1)
            sp = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            chosen = np.argsort(-(sp + p["router_bias"][i]), kind="stable")[:layer.sub_top_k]
            y = sum(expert(i * n_sub + j, v) for j in range(n_s))
            y = y + sum((1 + sp[j] * p["u"][i, j]) * expert(i * n_sub + n_s + j, v) for j in chosen)
            out[t] += wi * y
    return out


@pytest.mark.parametrize("router", ["linear", "cmoe"])
def test_flattened_dispatch_equals_per_expert_loop(router):
    layer = HierMoEFFN(16, 4, 4, 2, sub_experts=4, sub_shared=1, sub_top_k=2, sub_router_neurons=2,
                       router=router, rngs=nnx.Rngs(3))
    layer.u[...] = jax.random.normal(jax.random.key(1), layer.u[...].shape)
    layer.router_bias[...] = 0.01 * jax.random.normal(jax.random.key(2), layer.router_bias[...].shape)
    x = jax.random.normal(jax.random.key(0), (24, 16))
    np.testing.assert_allclose(np.asarray(layer(x)), _loop_reference(layer, x), atol=1e-5)


def test_flops_fall_by_the_predicted_fraction(moe_source):
    _, model = moe_source
    plan = MoEPlan(1, 1, 4)
    hier, _ = convert_moe_model(model, _calib(), ConvertConfig(plan=plan, k_act=4, router_neurons=2),
                                progress=False)
    d = model.config.hidden_size
    src = next(s for s in model.config.moe_layers if s is not None)
    spec = next(s for s in hier.config.moe_layers if s is not None)
    before, after = flops_per_token(d, src), flops_per_token(d, spec)
    # predicted: k (N'_s + N'_k) / N' of the expert FLOPs, plus k sub-routers of N'_r * r neurons
    k, d_e, n_r = src.top_k, src.expert_width, plan.routed
    assert after["experts"] == before["experts"] * (plan.shared + plan.active) // plan.total
    assert after["sub_router"] == k * 2 * 2 * d * n_r * 2
    # counted: the rows the one dispatch runs per token, and the sub-router columns it scores
    x = jax.random.normal(jax.random.key(0), (10, d))
    layer = next(l.mlp for l in hier.layers if isinstance(l.mlp, HierMoEFFN))
    ids, _ = layer.route(x)
    rows_per_token = ids.shape[1]
    assert rows_per_token * 3 * 2 * d * spec.expert_width == after["experts"]
    assert layer.sub_gate[...].shape[2] * 2 * 2 * d * k == after["sub_router"]

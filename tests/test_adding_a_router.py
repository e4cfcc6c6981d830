"""docs/guides/adding-a-router.md works: its toy router, imported from the guide's code as a
user's module, routes as a direct recomputation says, and a model whose layers name it
saves, loads and exports to transformers with the same logits."""
from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cmoe_jax.checkpoint import save_converted
from cmoe_jax.loading import load_model
from cmoe_jax.models.ffn import filled_ffn
from cmoe_jax.moe import MoEFFN
from cmoe_jax.moe.routers import ROUTERS, get_router

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "adding-a-router.md"


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The guide's Python blocks as a module of their own (the export reads the torch
    function's source from its file)."""
    blocks = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), flags=re.S | re.M)
    path = tmp_path_factory.mktemp("toy") / "toy_router.py"
    path.write_text("\n".join(blocks))
    spec = importlib.util.spec_from_file_location("toy_router", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["toy_router"] = module
    spec.loader.exec_module(module)
    yield module
    ROUTERS.pop("cosine", None)
    sys.modules.pop("toy_router", None)


def test_the_toy_routes_as_recomputed(toy):
    layer = MoEFFN(d_model=16, expert_width=8, num_experts=6, top_k=2, router="cosine",
                   activation="silu", rngs=nnx.Rngs(1))
    x = np.random.default_rng(0).normal(size=(10, 16)).astype(np.float32)
    ids, gates = layer.route(jnp.asarray(x))
    w = np.asarray(layer.router_kernel[...])
    cos = (x / np.linalg.norm(x, axis=1, keepdims=True)) @ (w / np.linalg.norm(w, axis=0, keepdims=True))
    probs = np.exp(10 * cos) / np.exp(10 * cos).sum(1, keepdims=True)
    want = np.argsort(-probs, axis=1)[:, :2]
    np.testing.assert_array_equal(np.asarray(ids), want)
    np.testing.assert_allclose(np.asarray(gates), np.take_along_axis(probs, want, 1), rtol=1e-5)
    y = np.asarray(layer(jnp.asarray(x)))
    want_y = np.zeros_like(x)
    for t in range(10):
        for e, g in zip(want[t], np.take_along_axis(probs, want, 1)[t]):
            gate, up, down = (np.asarray(getattr(layer, n)[...][e]) for n in ("expert_gate", "expert_up", "expert_down"))
            h = x[t] @ gate
            want_y[t] += g * ((h / (1 + np.exp(-h)) * (x[t] @ up)) @ down)
    np.testing.assert_allclose(y, want_y, atol=1e-5)


def test_an_unknown_router_names_the_known_ones():
    with pytest.raises(ValueError, match="router must be one of .*'cmoe'.*got 'nope'"):
        get_router("nope")


def test_a_model_with_the_toy_router_saves_loads_and_exports(toy, save_tiny, tmp_path):
    from test_export_moe import TOKENS, carved_llama, exported, transformers_logits
    moe = carved_llama(save_tiny).unstacked()
    specs = [dataclasses.replace(s, router="cosine", router_neurons=1) if s else None
             for s in moe.config.moe_layers]
    cfg = moe.config.with_moe_layers(specs)
    rng = np.random.default_rng(3)
    ffns = []
    for layer, spec in zip(moe.layers, specs):
        values = {k: v for k, v in nnx.to_pure_dict(nnx.state(layer.mlp)).items()
                  if k in ("expert_gate", "expert_up", "expert_down", "shared_gate", "shared_up", "shared_down")}
        values["router_kernel"] = rng.normal(size=(cfg.hidden_size, spec.num_experts)).astype(np.float32)
        ffns.append(filled_ffn(cfg, spec, values, jnp.float32))
    model = moe.with_ffns(cfg, ffns)
    logits = np.asarray(model(jnp.asarray(TOKENS)))
    save_converted(model, {"source_model": "tiny", "method": "test"}, tmp_path / "saved")
    reloaded = load_model(str(tmp_path / "saved"), progress=False).model
    np.testing.assert_allclose(np.asarray(reloaded(jnp.asarray(TOKENS))), logits, atol=1e-5)
    _, hf = exported(model, tmp_path)
    assert "def torch_cosine_route" in (hf / "modeling_cmoe.py").read_text()
    np.testing.assert_allclose(transformers_logits(hf), logits, atol=1e-4)

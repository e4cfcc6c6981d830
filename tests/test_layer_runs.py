"""Layers that differ, stored as runs (`cmoe_jax.models.stack.LayerRuns`): consecutive layers of
one shape stacked and scanned, the others on their own. Each behaviour is checked against
the same model with one module per layer (`Decoder.unstacked`, run unrolled): the forward,
its FFN inputs and expert loads, the LoRA loss and gradients, cached decoding (and the
uncached argmax), the checkpoint on disk and the layer edits."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cmoe_jax.checkpoint import restore_model, save_converted
from cmoe_jax.convert import ConvertConfig, convert_model
from cmoe_jax.generate import Decoding, generate
from cmoe_jax.methods.cmoe import MoEPlan
from cmoe_jax.models import Decoder, ModelConfig
from cmoe_jax.models.kv_cache import KVCache
from cmoe_jax.models.stack import LayerRuns, LayerStack, layered_state, runs_of
from cmoe_jax.sharding import logical_axes
from tests.test_kv_cache import _assert_uncached_argmax, _prompts
from tests.test_layer_stack import assert_same_forward, assert_same_lora_loss_and_gradients

CFG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                  num_layers=6, num_heads=4, num_kv_heads=2, head_dim=8, activation="silu",
                  max_position_embeddings=64)
A, B = MoEPlan(1, 1, 8), MoEPlan(2, 2, 8)
PLANS = (A, A, None, B, B, MoEPlan(1, 2, 8))  # runs [0, 1], [2], [3, 4], [5]


def _tokens(b=2, t=12, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 96, (b, t)), jnp.int32)


@pytest.fixture(scope="module")
def runs():
    """(the conversion to PLANS, held as runs; the same model with one module per layer)."""
    dense = Decoder(CFG, rngs=nnx.Rngs(0))
    calib = np.random.default_rng(0).integers(0, 96, size=(4, 32)).astype(np.int32)
    moe, _ = convert_model(dense, calib, ConvertConfig(plan=None, layer_plans=PLANS, k_act=4),
                           progress=False)
    return moe, moe.unstacked()


def test_consecutive_layers_of_one_shape_are_stacked(runs):
    moe, listed = runs
    assert isinstance(moe.layers, LayerRuns) and isinstance(listed.layers, nnx.List)
    assert moe.layers.sizes() == (2, 1, 2, 1) and moe.layers.starts() == (0, 2, 3, 5)
    assert [type(r) for r in moe.layers.runs] == [LayerStack, type(listed.layers[2]), LayerStack,
                                                  type(listed.layers[5])]
    h = jax.ShapeDtypeStruct((1, 2, 32), jnp.float32)
    assert runs_of(list(listed.layers), h, listed.rope(2)) == [[0, 1], [2], [3, 4], [5]]
    # a stacked run's variables carry the layer axis first, as a whole stack's do
    axes = logical_axes(moe)
    assert axes[("layers", "runs", 0, "stacked", "attn", "q_proj")][0] == "layers"
    assert axes[("layers", "runs", 1, "attn", "q_proj")][0] != "layers"
    for i in range(6):  # every layer reads as the listed model's
        np.testing.assert_array_equal(np.asarray(moe.layers[i].attn.q_proj[...]),
                                      np.asarray(listed.layers[i].attn.q_proj[...]))


def test_forward_inputs_and_loads_equal_the_unrolled_model(runs):
    moe, listed = runs
    assert_same_forward(moe, listed, ["0", "1", "3", "4", "5"])


def test_lora_loss_and_gradients_equal_the_unrolled_model(runs):
    """Dropout keys follow the model's layer index inside a run's scan, so the dropout masks,
    the loss and every gradient match the unrolled model's."""
    moe, listed = runs
    assert_same_lora_loss_and_gradients(moe, listed, ["0", "1", "3", "4", "5"])


@pytest.mark.parametrize("batch", [1, 3])
def test_every_cache_layout_holds_the_same_keys(runs, batch):
    """The runs' cache (`[n, ...]` a run, `[B K, S, H]` a lone layer) and one `[L, ...]` array
    give the same hidden states and keys through a prefill, a growth and a decode step, and
    so does the unrolled model's per-layer cache; a per-layer cache does not fit the runs."""
    moe, listed = runs
    assert [x.shape for x in moe.empty_cache(batch, 8).k] == [
        (2, batch, 2, 8, 8), (batch * 2, 8, 8), (2, batch, 2, 8, 8), (batch * 2, 8, 8)]
    tokens = _tokens(batch, 6)
    positions = jnp.broadcast_to(jnp.arange(6), (batch, 6))
    results = []
    for model, cache in ((moe, moe.empty_cache(batch, 8)),
                         (moe, KVCache.empty(CFG, batch, 8, jnp.float32)),
                         (listed, listed.empty_cache(batch, 8))):
        h, cache = model.run_cached(tokens, positions, cache.mark(jnp.ones((batch, 6), bool), 0), 0)
        cache = cache.grow(16).mark(jnp.ones((batch, 1), bool), 6)
        h2, cache = model.run_cached(tokens[:, :1], jnp.full((batch, 1), 6), cache, 6)
        per_layer = lambda xs: np.concatenate([np.asarray(x).reshape(-1, batch, 2, 16, 8)
                                               for x in (xs if isinstance(xs, tuple) else (xs,))])
        results.append((h, h2, per_layer(cache.k), per_layer(cache.v)))
    for other in results[1:]:
        for got, want in zip(other, results[0]):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="empty_cache"):
        moe.run_cached(tokens, positions, KVCache.empty(CFG, batch, 8, jnp.float32, per_layer=True), 0)


def test_cached_generation_is_the_uncached_argmax(runs):
    moe, _ = runs
    prompts = _prompts(lengths=(6, 11, 2))
    outputs = generate(moe, prompts, Decoding(12, batch_size=4))
    _assert_uncached_argmax(moe, prompts, outputs)


def test_checkpoint_stays_per_layer_and_restores_as_runs(runs, tmp_path):
    moe, listed = runs
    save_converted(moe, {"source_model": "tiny"}, tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m" / "state").iterdir()) == [
        *(f"layer_{i:04d}" for i in range(6)), "rest"]
    back = restore_model(tmp_path / "m")
    assert isinstance(back.layers, LayerRuns) and back.layers.sizes() == (2, 1, 2, 1)
    flat = lambda m: {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(layered_state(m))}
    got, want = flat(back), flat(listed)
    assert sorted(got, key=str) == sorted(want, key=str)
    for p in want:
        np.testing.assert_array_equal(got[p], want[p], err_msg=str(p))
    tokens = _tokens()
    np.testing.assert_array_equal(np.asarray(back(tokens)), np.asarray(moe(tokens)))


def test_set_layer_writes_into_a_run_and_another_shape_unstacks(runs):
    moe, listed = runs
    model, reference = nnx.clone(moe), nnx.clone(listed)
    new = nnx.clone(listed.layers[4])
    new.attn.q_proj[...] = 2.0 * new.attn.q_proj[...]
    model.set_layer(4, new)
    reference.layers[4] = new
    assert isinstance(model.layers, LayerRuns)
    tokens = _tokens()
    np.testing.assert_allclose(np.asarray(model(tokens)), np.asarray(reference(tokens)), atol=1e-5)
    model.set_layer(1, nnx.clone(listed.layers[2]))  # the dense layer into the first run
    reference.layers[1] = nnx.clone(listed.layers[2])
    assert isinstance(model.layers, nnx.List)
    np.testing.assert_allclose(np.asarray(model(tokens)), np.asarray(reference(tokens)), atol=1e-5)

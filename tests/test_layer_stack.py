"""Decoder layers stored stacked (`cmoe_jax.models.stack`): which models stack, the scanned
forward against the unrolled one, training reading the stacked weights in place, and
checkpoints that stay per layer."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from cmoe_jax.checkpoint import restore_model, save_converted
from cmoe_jax.models import Decoder, ModelConfig
from cmoe_jax.models.stack import STACKED, LayerStack, layered_state
from cmoe_jax.sharding import make_mesh, place_state, shardings_of
from cmoe_jax.train import AdapterSet, LoRAConfig, init_adapters, lora_loss, router_params
from conftest import dense_and_converted

CFG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                  num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, activation="silu", max_position_embeddings=64)
QWEN_MOE = {"model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
            "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
            "max_position_embeddings": 64}


def _tokens(b=2, t=12, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 96, (b, t)), jnp.int32)


@pytest.fixture(scope="module")
def converted():
    return dense_and_converted(CFG, "S1A1E4")


def test_uniform_models_stack_and_mixed_ones_do_not():
    assert isinstance(Decoder(CFG).layers, LayerStack)
    assert isinstance(Decoder(ModelConfig.from_hf(QWEN_MOE)).layers, LayerStack)
    mixed = ModelConfig.from_hf({**QWEN_MOE, "mlp_only_layers": [1]})  # layer 1 dense
    assert isinstance(Decoder(mixed).layers, nnx.List)
    one = Decoder(ModelConfig(**{**CFG.__dict__, "num_layers": 1}))
    assert isinstance(one.layers, nnx.List)
    state = nnx.state(Decoder(CFG))
    assert state["layers"][STACKED]["attn"]["q_proj"].get_value().shape == (3, 32, 32)


def assert_same_forward(model, reference, routed: list[str]):
    """`run_layers` gives the same stream, FFN inputs and expert loads (of the `routed`
    layers) on `model` as on `reference` (the same weights held another way)."""
    tokens = _tokens()
    h1, x1, loads1 = model.run_layers(tokens, capture=True)
    h2, x2, loads2 = reference.run_layers(tokens, capture=True)
    np.testing.assert_allclose(np.asarray(h1), np.asarray(h2), atol=1e-5)
    assert len(x1) == len(x2) == model.config.num_layers
    for a, b in zip(x1, x2):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert sorted(loads1) == sorted(loads2) == routed
    for k in loads1:
        np.testing.assert_array_equal(np.asarray(loads1[k]), np.asarray(loads2[k]))


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_scanned_forward_equals_the_unrolled_one(converted, which):
    model = dict(zip(("dense", "moe"), converted))[which]
    assert isinstance(model.layers, LayerStack)
    per_layer = model.unstacked()
    assert isinstance(per_layer.layers, nnx.List)
    assert_same_forward(model, per_layer, [] if which == "dense" else ["0", "1", "2"])
    # a view of layer i holds layer i's weights
    np.testing.assert_array_equal(np.asarray(model.layers[2].attn.q_proj[...]),
                                  np.asarray(per_layer.layers[2].attn.q_proj[...]))


def assert_same_lora_loss_and_gradients(model, reference, routed: list[str]):
    """The LoRA loss (dropout on, remat on), its expert loads and its gradients with respect to
    the adapters and the router scales are the same on `model` as on `reference` (the same
    weights held another way); `routed`: the layers whose router scales train."""
    lora = LoRAConfig(rank=4, alpha=8, dropout=0.2)
    adapters = init_adapters(model, lora, jax.random.key(0))
    adapters = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(1), a.shape), adapters)
    us, bs = router_params(model)
    assert sorted(us) == routed
    tokens, key = _tokens(2, 16, 3), jax.random.key(7)

    def grads(m):
        f = lambda ad, u: lora_loss(m, AdapterSet(ad, u, bs, lora.scale, dropout=0.2), tokens,
                                    key=key, remat=True)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(adapters, us)

    (l1, loads1), g1 = grads(model)
    (l2, loads2), g2 = grads(reference)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)
    for k in loads1:
        np.testing.assert_array_equal(np.asarray(loads1[k]), np.asarray(loads2[k]))
    assert jax.tree.structure(g1) == jax.tree.structure(g2)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-4)


def test_training_loss_and_gradients_equal_the_per_layer_model(converted):
    _, moe = converted
    assert_same_lora_loss_and_gradients(moe, moe.unstacked(), ["0", "1", "2"])


def test_the_loss_reads_stacked_weights_in_place(converted):
    """Nothing in the traced loss builds an array of a stacked weight's shape: the scan slices
    the weights where they lie (the adapters, small, are what gets stacked)."""
    _, moe = converted
    lora = LoRAConfig(rank=4, alpha=8)
    adapters = init_adapters(moe, lora, jax.random.key(0))
    us, bs = router_params(moe)
    graphdef, frozen = nnx.split(moe)
    weight_shapes = {tuple(v.get_value().shape) for p, v in nnx.to_flat_state(frozen)
                     if p[:2] == ("layers", STACKED) and np.prod(v.get_value().shape) > 64 * 4}
    tokens = _tokens(2, 16)
    jaxpr = jax.make_jaxpr(lambda fr, ad: lora_loss(nnx.merge(graphdef, fr),
                                                    lora.applied(ad, us, bs), tokens))(frozen, adapters)
    top = jaxpr.jaxpr
    assert any(e.primitive.name == "scan" for e in top.eqns)
    built = {tuple(v.aval.shape) for e in top.eqns if e.primitive.name != "scan" for v in e.outvars}
    assert not built & weight_shapes


def test_checkpoints_stay_per_layer_and_restore_stacked(converted, tmp_path):
    _, moe = converted
    save_converted(moe, {"source_model": "tiny"}, tmp_path / "m")
    # on disk: one checkpoint per layer index, read here into one layer module's state
    per_layer = nnx.eval_shape(lambda: Decoder(moe.config, stack=False))
    target = place_state(nnx.state(per_layer), shardings_of(per_layer, make_mesh()))
    assert sorted(p.name for p in (tmp_path / "m" / "state").iterdir()) == [
        "layer_0000", "layer_0001", "layer_0002", "rest"]
    raw = ocp.StandardCheckpointer().restore((tmp_path / "m" / "state" / "layer_0001").absolute(),
                                             target["layers"][1])
    np.testing.assert_array_equal(np.asarray(raw["mlp"]["expert_gate"].get_value()),
                                  np.asarray(moe.layers[1].mlp.expert_gate[...]))
    back = restore_model(tmp_path / "m")
    assert isinstance(back.layers, LayerStack)
    tokens = _tokens()
    np.testing.assert_array_equal(np.asarray(back(tokens)), np.asarray(moe(tokens)))
    flat = {p: v.get_value() for p, v in nnx.to_flat_state(layered_state(back))}
    assert ("layers", 1, "mlp", "expert_gate") in flat
    apart = restore_model(tmp_path / "m", stack=False)  # one module a layer, as saved
    assert isinstance(apart.layers, nnx.List) and len(apart.layers) == 3
    np.testing.assert_allclose(np.asarray(apart(tokens)), np.asarray(moe(tokens)), rtol=1e-6, atol=1e-6)


def test_a_write_through_a_stacked_layer_view_raises():
    from cmoe_jax.models.stack import LayerViewError

    model = Decoder(CFG)
    view = model.layers[1]
    with pytest.raises(LayerViewError, match="set_layer"):
        view.mlp.gate[...] = jnp.zeros_like(view.mlp.gate[...])
    with pytest.raises(LayerViewError):
        view.mlp = view.attn
    with pytest.raises(LayerViewError):
        view.attn.q_proj = nnx.Param(jnp.zeros((32, 32)))
    out = view(jnp.zeros((1, 4, 32)), model.rope(4))  # reading and running a view is fine
    assert out.h.shape == out.ffn_input.shape == (1, 4, 32) and out.load is None


@pytest.mark.parametrize("stacked", [True, False])
def test_set_layer_replaces_one_layer_on_stacked_and_listed_models(stacked):
    model = Decoder(CFG) if stacked else Decoder(CFG).unstacked()
    reference = Decoder(CFG).unstacked()  # same seed: same weights, one module per layer
    new = nnx.clone(reference.layers[1])
    new.mlp.up[...] = 2.0 * new.mlp.up[...]
    model.set_layer(1, new)
    reference.layers[1] = new
    assert isinstance(model.layers, LayerStack) == stacked
    tokens = _tokens()
    np.testing.assert_allclose(np.asarray(model(tokens)), np.asarray(reference(tokens)), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(model.layers[1].mlp.up[...]), np.asarray(new.mlp.up[...]))
    np.testing.assert_array_equal(np.asarray(model.layers[0].mlp.up[...]),
                                  np.asarray(reference.layers[0].mlp.up[...]))


def test_set_layer_of_another_structure_unstacks_the_model(converted):
    dense, moe = converted
    model = nnx.clone(dense)
    model.set_layer(2, nnx.clone(moe.unstacked().layers[2]))  # an MoE layer among dense ones
    assert isinstance(model.layers, nnx.List)
    tokens = _tokens()
    h, _, loads = model.run_layers(tokens)
    assert sorted(loads) == ["2"]
    expected = dense.unstacked()
    expected.layers[2] = moe.unstacked().layers[2]
    np.testing.assert_allclose(np.asarray(h), np.asarray(expected.run_layers(tokens)[0]), atol=1e-5)


def test_scanned_layers_gather_whole_slices_and_layers_of_their_own_in_slabs(monkeypatch):
    """A layer in the scan takes its weights as slices of the stack's, which a loop over slabs
    would copy whole: it gathers whole expert slices (`sliced_weights`); the same layers held
    apart gather in the platform's slabs. Both give the same forward."""
    import cmoe_jax.moe.modes as modes
    from cmoe_jax.moe.modes import DENSE_WHEN, Slabs

    backend = jax.default_backend()
    monkeypatch.setitem(DENSE_WHEN, backend, DENSE_WHEN.get(backend, DENSE_WHEN["cpu"])._replace(
        gather_share=1.0, gather_slab_bytes=64, gather_slab_steps=4, gather_slab_min_bytes=0))
    stacked = Decoder(ModelConfig.from_hf(QWEN_MOE), rngs=nnx.Rngs(0))
    apart = stacked.unstacked()
    assert isinstance(stacked.layers, LayerStack) and apart is not stacked
    seen, real = [], modes.gathered_experts
    monkeypatch.setattr(modes, "gathered_experts",
                        lambda *a, slabs=None, **kw: seen.append(slabs) or real(*a, slabs=slabs, **kw))
    tokens = _tokens(b=1, t=1)
    h_stacked = stacked.run_layers(tokens)[0]
    assert seen == [None]                                  # one trace of the scanned layer
    h_apart = apart.run_layers(tokens)[0]
    assert seen[1:] == [Slabs(64, 4)] * 3                  # each layer of its own
    np.testing.assert_allclose(np.asarray(h_apart), np.asarray(h_stacked), rtol=1e-5, atol=1e-5)


def test_a_stacked_restore_holds_no_layer_it_has_read(converted, tmp_path, monkeypatch):
    """Restoring into stacks copies each layer into its rows as it is read: while layer i is
    read, no array of layers 0..i-1 is alive (the model is held once, not once per layer
    and again stacked)."""
    import cmoe_jax.checkpoint.restore as restore

    _, moe = converted
    save_converted(moe, {"source_model": "tiny"}, tmp_path / "m")
    layer_bytes = sum(v.get_value().nbytes for _, v in nnx.to_flat_state(layered_state(moe)["layers"][0]))
    held = []

    def at_layer(name):
        if name == "read:layer":
            held.append(sum(a.nbytes for a in jax.live_arrays()))
    monkeypatch.setattr(restore, "fault_point", at_layer)
    back = restore_model(tmp_path / "m")
    assert len(held) == moe.config.num_layers
    # what each read finds alive beyond the start: the "rest" part and at most the last layer
    grown = [h - held[0] for h in held]
    assert max(grown) <= layer_bytes, (grown, layer_bytes)
    np.testing.assert_array_equal(np.asarray(back(_tokens())), np.asarray(moe(_tokens())))

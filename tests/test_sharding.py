"""Sharding rules as data: every variable's logical axes, the rules table, bad declarations."""
from __future__ import annotations

import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec as P

from cmoe_jax.models import Decoder, ModelConfig
from cmoe_jax.sharding import ShardingError, logical_axes, make_mesh, shardings_of, spec_for

DENSE = ModelConfig(model_type="qwen2", vocab_size=96, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, activation="silu",
                    max_position_embeddings=64, attention_bias=True, tie_word_embeddings=False)
MOE = ModelConfig.from_hf({"model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 32,
                           "intermediate_size": 64, "moe_intermediate_size": 16,
                           "num_hidden_layers": 2, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "head_dim": 8, "num_experts": 8,
                           "num_experts_per_tok": 2, "max_position_embeddings": 64})


def _abstract(cfg, stack=False):
    return nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), stack=stack))


@pytest.mark.parametrize("stack", [False, True], ids=["per-layer", "stacked"])
@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_every_variable_has_logical_axes_of_its_rank(cfg, stack):
    model = _abstract(cfg, stack)
    axes = logical_axes(model)
    flat = {tuple(p): v.get_value().shape for p, v in nnx.to_flat_state(nnx.state(model))}
    assert set(axes) == set(flat)
    for path, shape in flat.items():
        assert len(axes[path]) == len(shape), path


def test_rules_split_projections_megatron_style():
    mesh = AbstractMesh((2, 4), ("data", "model"))
    sh = {p: s.spec for p, s in shardings_of(_abstract(DENSE), mesh).items()}
    assert sh[("layers", 0, "attn", "q_proj")] == P(None, "model")     # columns
    assert sh[("layers", 0, "attn", "o_proj")] == P("model")           # rows
    assert sh[("layers", 0, "mlp", "gate")] == P(None, "model")
    assert sh[("layers", 0, "mlp", "down")] == P("model")
    assert sh[("layers", 0, "attn", "q_bias")] == P("model")
    assert sh[("layers", 1, "input_norm", "weight")] == P()
    assert sh[("embed",)] == P() and sh[("lm_head",)] == P(None, "model")
    # k/v: 2 heads x 8 = 16 columns split over 4; a dimension the axis does not divide stays whole
    assert sh[("layers", 0, "attn", "k_proj")] == P(None, "model")
    assert spec_for(("embed", "kv_heads"), (32, 6), mesh) == P()


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_stacked_layers_shard_like_each_layer_with_the_layer_axis_whole(cfg):
    mesh = AbstractMesh((1, 2, 4), ("data", "expert", "model"))
    per_layer = {p: s.spec for p, s in shardings_of(_abstract(cfg), mesh).items()}
    stacked = {p: s.spec for p, s in shardings_of(_abstract(cfg, stack=True), mesh).items()}
    assert ("layers", "stacked", "attn", "q_proj") in stacked
    for path, spec in stacked.items():
        if path[0] != "layers":
            assert spec == per_layer[path]
            continue
        for i in range(cfg.num_layers):
            one = per_layer[("layers", i, *path[2:])]
            assert spec == (P(None, *one) if len(one) else P()), path


def test_expert_axis_goes_to_an_expert_mesh_axis_when_there_is_one():
    model = _abstract(MOE)
    path = ("layers", 0, "mlp", "expert_gate")
    no_expert = shardings_of(model, AbstractMesh((2, 4), ("data", "model")))
    assert no_expert[path].spec == P("model")  # experts over "model"; "model" is then used up
    with_expert = shardings_of(model, AbstractMesh((1, 4, 2), ("data", "expert", "model")))
    assert with_expert[path].spec == P("expert", None, "model")
    assert with_expert[("layers", 0, "mlp", "expert_down")].spec == P("expert", "model")
    assert with_expert[("layers", 0, "mlp", "router_kernel")].spec == P()
    # 8 experts do not divide over 3 devices: the expert dimension stays whole, m is split
    assert spec_for(("expert", "embed", "mlp"), (8, 32, 6), AbstractMesh((1, 3), ("data", "model"))) \
        == P(None, None, "model")


def test_single_device_mesh_replicates_everything():
    mesh = make_mesh(devices=[None])  # shapes only: one device on "data", "model" of size 1
    assert dict(mesh.shape) == {"data": 1, "model": 1}
    assert all(s.spec == P() for s in shardings_of(_abstract(MOE), mesh).values())


class Undeclared(nnx.Module):
    LOGICAL_AXES = {"w": ("embed", "mlp")}

    def __init__(self):
        self.w = nnx.Param(jnp.zeros((4, 8)))
        self.extra = nnx.Param(jnp.zeros((8,)))


def test_an_undeclared_variable_is_an_error_not_replication():
    with pytest.raises(ShardingError, match="Undeclared/extra|extra of Undeclared"):
        logical_axes(Undeclared())
    with pytest.raises(ShardingError, match="no rule"):
        spec_for(("embed", "nonsense"), (4, 8), AbstractMesh((1, 2), ("data", "model")))
    with pytest.raises(ShardingError, match="do not match"):
        spec_for(("embed",), (4, 8), AbstractMesh((1, 2), ("data", "model")))


def test_mesh_factory_shapes_and_errors():
    devices = list(range(8))
    m = make_mesh(model=2, devices=devices)
    assert dict(m.shape) == {"data": 4, "model": 2}
    e = make_mesh(2, 2, expert=2, devices=devices)
    assert e.axis_names == ("data", "expert", "model") and dict(e.shape)["expert"] == 2
    with pytest.raises(ShardingError, match="needs 128 devices"):
        make_mesh(64, 2, devices=devices)

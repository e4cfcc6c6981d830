"""Carved and compressed MoE-source models exported with `cmoe_jax.export` (remote code
`modeling_cmoe.py` on the family's own transformers class) load in transformers and give
our logits: hierarchical CMoE (sub-experts under each parent expert, the parent router kept),
ConMoE and its pruning / merging baselines (a prototype table behind the router's slots), on
Qwen2-MoE (its shared expert and sigmoid gate kept), OLMoE, Qwen3-MoE and Mixtral."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from cmoe_jax.checkpoint import save_converted
from cmoe_jax.convert import ConvertConfig, convert_model
from cmoe_jax.export import ExportSettings, export
from cmoe_jax.loading import load_model
from cmoe_jax.methods.cmoe import MoEPlan
from cmoe_jax.methods.conmoe import apply_plans, baseline_plans, collect_stats, conmoe_plans
from cmoe_jax.methods.hierarchical.convert import convert_moe_model
from conftest import save_tiny_tokenizer, write_random_text

CALIB = np.random.default_rng(0).integers(0, 96, (4, 32)).astype(np.int32)
TOKENS = np.random.default_rng(5).integers(0, 96, (2, 24)).astype(np.int32)
FAMILIES = ["qwen2_moe", "olmoe", "qwen3_moe", "mixtral"]


def hierarchical(model):
    hier, _ = convert_moe_model(model, CALIB, ConvertConfig(plan=MoEPlan(1, 2, 4), k_act=4,
                                                            router_neurons=2), progress=False)
    return hier


def compressed(model, method: str, scope: int = 1, duplicate_gates: str = "sum"):
    stats = collect_stats(model, CALIB[:2], progress=False)
    if method == "conmoe":
        plans, _ = conmoe_plans(model, stats, 0.5, scope, "adaptive")
    else:
        plans = baseline_plans(method, stats, 0.5, model)
    return apply_plans(model, plans, duplicate_gates)


def trained(model):
    """Router scales u and balancing biases made non-zero (zero at conversion), as after
    fine-tuning, so the gates and the biased choices are exercised too."""
    model = model.unstacked()
    for i, layer in enumerate(model.layers):
        for name in ("u", "top_u", "router_bias", "top_bias"):
            var = getattr(layer.mlp, name, None)
            if var is not None:
                size = int(np.prod(var.shape))
                var[...] = jnp.linspace(-0.5 if "bias" in name else -2.0, 0.5 if "bias" in name else 2.0,
                                        size).reshape(var.shape)
        model.set_layer(i, layer)
    return model


def carved_llama(save_tiny, **options):
    """A tiny Llama carved by CMoE (S2A2E8): an MoE whose router is CMoE's own."""
    _, path = save_tiny("llama", intermediate_size=64)
    dense = load_model(str(path), progress=False).model
    moe, _ = convert_model(dense, CALIB, ConvertConfig(plan=MoEPlan.parse("S2A2E8"), k_act=4, **options),
                           progress=False)
    return moe


def exported(model, tmp_path):
    src = tmp_path / "converted"
    save_converted(model, {"source_model": "tiny", "method": "test"}, src)
    record = export(str(src), ExportSettings(calib_samples=0), out=tmp_path / "hf", progress=False)
    return record, tmp_path / "hf"


def transformers_logits(directory):
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), trust_remote_code=True, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return ref.eval()(torch.from_numpy(TOKENS.astype(np.int64))).logits.numpy()


def _check(model, tmp_path, family):
    record, hf = exported(model, tmp_path)
    config = json.loads((hf / "config.json").read_text())
    assert record["remote_code"] and config["model_type"] == f"cmoe_{family}"
    np.testing.assert_allclose(transformers_logits(hf), np.asarray(model(jnp.asarray(TOKENS))), atol=1e-4)
    return config


@pytest.fixture(params=FAMILIES)
def moe_source(request, save_tiny):
    _, path = save_tiny(request.param)
    return request.param, load_model(str(path), progress=False).model


def test_hierarchical_exports(moe_source, tmp_path):
    family, model = moe_source
    config = _check(trained(hierarchical(model)), tmp_path, family)
    assert any(s and s["sub_experts"] == 4 for s in config["moe_layers"])


@pytest.mark.parametrize("method", ["conmoe", "frequency", "msmoe"])
def test_conmoe_and_baselines_export(moe_source, tmp_path, method):
    family, model = moe_source
    config = _check(compressed(model, method), tmp_path, family)
    assert any(s and s["num_prototypes"] for s in config["moe_layers"])


@pytest.mark.parametrize("method", ["reap", "hcsmoe"])
def test_qwen2_moe_baselines_keep_the_gated_shared_expert(save_tiny, tmp_path, method):
    _, path = save_tiny("qwen2_moe")
    config = _check(compressed(load_model(str(path), progress=False).model, method), tmp_path, "qwen2_moe")
    assert all(s["shared_gated"] and s["shared_width"] == 24 for s in config["moe_layers"] if s)


@pytest.mark.parametrize("rule", ["max", "renorm"])
def test_duplicate_gate_rules_export(save_tiny, tmp_path, rule):
    _, path = save_tiny("olmoe")
    _check(compressed(load_model(str(path), progress=False).model, "msmoe", duplicate_gates=rule),
           tmp_path, "olmoe")


def test_cross_layer_scope_exports_one_table(save_tiny, tmp_path):
    """A ConMoE scope over both layers: one prototype table, written once, read by both."""
    _, path = save_tiny("olmoe")
    model = compressed(load_model(str(path), progress=False).model, "conmoe", scope=2)
    config = _check(model, tmp_path, "olmoe")
    assert [s["prototype_owner"] for s in config["moe_layers"]] == [0, 0]
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "np") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.expert_gate" in keys and "model.layers.1.mlp.expert_gate" not in keys


def test_hierarchical_cmoe_of_a_cmoe_model_exports(save_tiny, tmp_path):
    """Hierarchical CMoE on a CMoE-carved Llama: the parent router is CMoE's own (its
    neurons, scales and biases kept as top_*), under the remote code's Llama class."""
    moe = carved_llama(save_tiny)
    hier, _ = convert_moe_model(moe, CALIB, ConvertConfig(plan=MoEPlan(1, 1, 2), k_act=2,
                                                          router_neurons=1), progress=False)
    config = _check(trained(hier), tmp_path, "llama")
    assert all(s["router"] == "cmoe" and s["sub_experts"] == 2 for s in config["moe_layers"])


def test_skip_compensation_exports(save_tiny, tmp_path):
    """A CMoE-carved Llama whose skipped experts are predicted from the router's h
    (`skip_down`, fitted): the remote code adds the same term."""
    moe = carved_llama(save_tiny, skip_compensation=True, router_neurons=2)
    config = _check(trained(moe), tmp_path, "llama")
    assert all(s["skip_compensation"] for s in config["moe_layers"])


def test_threshold_routing_exports(save_tiny, tmp_path):
    """A CMoE-carved Llama routed by a fitted threshold (a token runs its experts whose score
    reaches it, up to all of them), with the skipped experts' term: the remote code drops
    the same pairs and predicts the same skipped experts."""
    moe = carved_llama(save_tiny, routing="threshold", skip_compensation=True, router_neurons=2)
    thresholds = [float(layer.mlp.router_threshold[0]) for layer in moe.unstacked().layers]
    assert all(t > 0 for t in thresholds)
    config = _check(trained(moe), tmp_path, "llama")
    assert all(s["threshold_routing"] and s["top_k"] == 6 for s in config["moe_layers"])


@pytest.mark.parametrize("method", ["conmoe", "frequency"])
def test_compressed_cmoe_model_exports(save_tiny, tmp_path, method):
    """ConMoE / pruning on a CMoE-carved Llama: the cmoe router's slots masked or mapped."""
    moe = carved_llama(save_tiny)
    config = _check(compressed(trained(moe), method), tmp_path, "llama")
    assert all(s["router"] == "cmoe" and s["num_prototypes"] for s in config["moe_layers"])


def test_conmoe_on_hierarchical_layers_exports(save_tiny, tmp_path):
    _, path = save_tiny("qwen2_moe")
    hier = trained(hierarchical(load_model(str(path), progress=False).model))
    config = _check(compressed(hier, "conmoe"), tmp_path, "qwen2_moe")
    assert any(s and s["sub_experts"] and s["num_prototypes"] for s in config["moe_layers"])


def test_carved_qwen2_moe_export_passes_its_own_check(save_tiny, tmp_path):
    """The export's verification (transformers' logits against ours on text windows) passes
    and is recorded."""
    _, path = save_tiny("qwen2_moe")
    model = trained(hierarchical(load_model(str(path), progress=False).model))
    src = tmp_path / "converted"
    save_converted(model, {"source_model": "tiny", "method": "hierarchical"}, src)
    save_tiny_tokenizer(src / "tokenizer")
    text = write_random_text(tmp_path / "text.txt", 2000)
    record = export(str(src), ExportSettings(data_path=str(text), calib_samples=2, seqlen=32),
                    out=tmp_path / "hf", progress=False)
    assert record["architecture"] == "CmoeQwen2MoeForCausalLM"
    assert record["verification"]["max_abs_logit_diff"] < 1e-4


def test_every_spec_field_reaches_the_torch_layer_or_is_refused():
    """`moe_layers` entries carry every FFNSpec field the torch layer takes; a field marked
    `jax_only` (a new dispatch option, say) is refused when set, never silently dropped."""
    import ast
    import dataclasses
    from pathlib import Path

    import cmoe_jax.export.hf_config as hf_config
    from cmoe_jax.moe.spec import FFNSpec, has_torch_form, jax_only

    tree = ast.parse((Path(hf_config.__file__).parent / "hf_remote" / "modeling_cmoe.py").read_text())
    layer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MoEMLP")
    takes = next(ast.literal_eval(n.value) for n in layer.body
                 if isinstance(n, ast.Assign) and n.targets[0].id == "SPEC")
    assert set(takes) == {f.name for f in dataclasses.fields(FFNSpec) if has_torch_form(f)} | {"router_params"}

    entry = hf_config._moe_layer(FFNSpec(4, 2, 8, router="cmoe"), 16, "silu")
    assert set(entry) == {f.name for f in dataclasses.fields(FFNSpec) if has_torch_form(f)} | {"router_params"}
    # the capacity factor is JAX-only: left out at its default, refused when set
    assert not has_torch_form(next(f for f in dataclasses.fields(FFNSpec) if f.name == "capacity_factor"))
    assert "capacity_factor" not in entry
    with pytest.raises(hf_config.ExportError, match="capacity_factor"):
        hf_config._moe_layer(FFNSpec(4, 2, 8, router="cmoe", capacity_factor=1.25), 16, "silu")
    wider = dataclasses.make_dataclass("WiderSpec", [("token_order", str, jax_only("slot"))],
                                       bases=(FFNSpec,), frozen=True)
    with pytest.raises(hf_config.ExportError, match="token_order"):
        hf_config._moe_layer(wider(4, 2, 8, router="cmoe", token_order="token"), 16, "silu")



@pytest.mark.parametrize("family,options", [
    ("qwen3_moe", {}), ("mixtral", {}),
    ("qwen3_moe", dict(router_scoring="sigmoid", routed_scaling=2.5, router_jitter=0.1))])
def test_a_linear_router_with_a_balancing_bias_exports_with_remote_code(save_tiny, tmp_path, family, options):
    """The family's own class has no balancing bias (nor sigmoid scores, nor a gate scale): the
    export takes the remote code, whose linear routing does as ours does (jitter only trains)."""
    import dataclasses

    from flax import nnx

    from cmoe_jax.models import Decoder

    _, path = save_tiny(family)
    source = load_model(str(path), progress=False).model
    cfg = source.config.with_moe_layers([s and dataclasses.replace(s, router_balance=True, **options)
                                         for s in source.config.moe_layers])
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(source, nnx.Param))
    config = _check(trained(model), tmp_path, family)
    assert all(entry["router_balance"] for entry in config["moe_layers"] if entry)

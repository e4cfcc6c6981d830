"""The shape of one MoE FFN layer, as configs and family units describe it and as
`MoEFFN` / `HierMoEFFN` are built from it (passed whole)."""
from __future__ import annotations

import dataclasses


_JAX_ONLY = "jax_only"


def jax_only(default):
    """A spec field the exported torch layer does not implement (see `FFNSpec`)."""
    return dataclasses.field(default=default, metadata={_JAX_ONLY: True})


def has_torch_form(field: dataclasses.Field) -> bool:
    """Whether the exported torch layer takes spec field `field` (all but `jax_only` ones)."""
    return not field.metadata.get(_JAX_ONLY, False)


@dataclasses.dataclass(frozen=True)
class FFNSpec:
    """Shape of one MoE FFN layer (sparse checkpoints and converted models).

    `router` is "linear" for Qwen3-MoE/Mixtral/ExpertWeaver (softmax gates, trains from
    scratch; `norm_topk_prob` renormalises the k gates to sum 1, as Mixtral), "cmoe" for the
    analytical router of a carved model (a fresh one gets zero gradients: its gates
    `1 + s' u` start at `u = 0`), "topsum"/"sum" (constant gates) for carved models too. `shared_width` is the width of the fused always-on MLP.
    `router_neurons` is how many representative neurons score each expert (cmoe router).
    `num_prototypes` > 0 (ConMoE, `cmoe_jax.compress`): the layer stores that many prototype
    experts and an int32 slot -> prototype map (-1: slot pruned); `prototype_owner` >= 0
    names the layer whose prototype table this layer shares (a cross-layer scope);
    `duplicate_gates` is how a token's gates on slots sharing a prototype combine
    (`cmoe_jax.moe.prototypes`: "sum", the paper's, "max" or "renorm").

    Every field goes into an exported `config.json` and is an argument of the exported
    torch layer (`MoEMLP` in `cmoe_jax/export/hf_remote/modeling_cmoe.py`). A new field
    that the torch layer does not implement yet is declared `jax_only(default)`: the export
    then refuses a layer whose value differs from the default instead of writing a model
    that runs differently in torch.
    """

    num_experts: int
    top_k: int
    expert_width: int
    shared_width: int = 0
    router: str = "linear"
    norm_topk_prob: bool = False
    router_neurons: int = 1
    # Hierarchical CMoE (`cmoe_jax.moe.hierarchical`): with sub_experts N' > 0 each of the
    # num_experts experts is split into N' sub-experts of width expert_width (N'_s =
    # sub_shared always on with their expert, sub_top_k of the rest chosen by its sub-router
    # of sub_router_neurons neurons per sub-expert). 0: a plain MoE layer.
    sub_experts: int = 0
    sub_shared: int = 0
    sub_top_k: int = 0
    sub_router_neurons: int = 1
    num_prototypes: int = 0
    prototype_owner: int = -1
    duplicate_gates: str = "sum"
    # Qwen2-MoE: the shared MLP's output is scaled by sigmoid(x W_sg), W_sg [d, 1]
    shared_gated: bool = False
    # linear router: a balancing bias b [E] added to the probabilities for the choice only
    # (aux-loss-free balancing, DeepSeek-V3), moved by `update_bias`, never by the optimiser
    router_balance: bool = False
    # linear router: "softmax" or "sigmoid" scores (DeepSeek-V3; gates the chosen experts'
    # sigmoid scores, renormalised with norm_topk_prob), the gates times `routed_scaling`, and
    # in training (a `key` given) the router's input times U(1 - jitter, 1 + jitter) (Switch)
    router_scoring: str = "softmax"
    routed_scaling: float = 1.0
    router_jitter: float = 0.0
    # cmoe router: the experts a token skips add `(their router neurons' h) @ skip_down`
    # (`skip_down [E*r, d]`, fitted with the down projections; zero in a fresh layer): what
    # the skipped experts would have added, predicted from the activations the router has
    # already computed (`cmoe_jax.moe.skip_term`)
    skip_compensation: bool = False
    # cmoe router: a token runs those of its `top_k` best-scored experts whose score is at
    # least the layer's `router_threshold` (a scalar array, fitted at conversion so the
    # calibration tokens run the plan's share on average; 0 in a fresh layer: all `top_k`
    # run). `top_k` is then the most experts a token may run: a token the router is sure of
    # runs few, an unsure one more (`cmoe_jax.moe.routers.cmoe`)
    threshold_routing: bool = False
    # each expert runs at most ceil(capacity_factor * T * k / E) of a call's T tokens' pairs
    # (per device, expert-parallel), the rest dropped (`cmoe_jax.moe.token_pairs`); 0: dropless
    capacity_factor: float = jax_only(0.0)


def spec_with(spec: FFNSpec | None, fields: dict, owner: str = "MoEFFN") -> FFNSpec:
    """`spec` with `fields` replaced, or a spec of `fields` alone (`MoEFFN(d_model=..,
    expert_width=.., num_experts=.., top_k=.., ...)`); a name that is no field is an error."""
    known = {f.name for f in dataclasses.fields(FFNSpec)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"{owner} got unknown arguments {unknown}; its layer fields are {sorted(known)}")
    if spec is None:
        missing = [f for f in ("expert_width", "num_experts", "top_k") if f not in fields]
        if missing:
            raise TypeError(f"{owner} needs a spec or the fields {missing}")
        return FFNSpec(**fields)
    return dataclasses.replace(spec, **fields)

"""What a compression decides, per scope: a prototype table and each layer's slot map.

A `ScopePlan` covers consecutive MoE layers. Its prototype table is `mix @ experts`: row p
of `mix [K, n]` weighs the scope's n original experts (layer-major), one-hot for ConMoE and
pruning (a kept pretrained expert), usage-weighted for merging. `slot_maps[layer] [E]` sends
each router slot to a table row, -1 for a pruned slot. `perms[i]`, where given, reorders scope
expert i's neurons before mixing (M-SMoE's alignment; a neuron order changes no output).
`conmoe_plans` builds them with the ConMoE rule (`scoring`); `baselines` the pruning and
merging baselines.

The unit of compression is a top-level expert: a plain MoE layer's expert, or, in a
hierarchical layer (`HierMoEFFN`), an expert's family of S sub-experts with its sub-router
(`unit_weights`); distances use the family's gate/up/down weights, the table carries the
sub-router too.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from cmoe_jax.methods.conmoe import scoring
from cmoe_jax.models.stack import each_layer, layer_value

PROJECTIONS = ("expert_gate", "expert_up", "expert_down")
SUB_ROUTER = ("sub_gate", "sub_up", "u", "router_bias")  # a hierarchical family's sub-router


@dataclasses.dataclass
class ScopePlan:
    layers: list[int]
    mix: np.ndarray                  # [K, n] float64
    slot_maps: dict[int, np.ndarray]  # layer -> int32 [E]
    info: dict = dataclasses.field(default_factory=dict)
    perms: dict[int, np.ndarray] | None = None  # scope expert -> neuron order

    @property
    def num_prototypes(self) -> int:
        return self.mix.shape[0]

    def unit_layer(self, unit: int) -> int:
        """The layer of scope unit `unit` (the scope's experts numbered layer-major)."""
        ends = np.cumsum([len(self.slot_maps[l]) for l in self.layers])
        return self.layers[int(np.searchsorted(ends, unit, side="right"))]

    def to_json(self) -> dict:
        return {"layers": self.layers, "num_prototypes": self.num_prototypes,
                "slot_maps": {str(l): m.tolist() for l, m in self.slot_maps.items()},
                "mix": self.mix.tolist(), **self.info,
                **({"perms": {str(e): p.tolist() for e, p in self.perms.items()}} if self.perms else {})}


def unit_weights(model, layers) -> dict[str, np.ndarray]:
    """The units of `layers` stacked layer-major, `{name: [n, ...]}`: gate/up `[n, S, d, m]`,
    down `[n, S, m, d]` (S sub-experts per unit, 1 in a plain MoE layer) and, for
    hierarchical layers, the sub-router arrays `SUB_ROUTER` (`[n, ...]`)."""
    sub = getattr(each_layer(model)[layers[0]][0].mlp, "sub_experts", 0)
    out = {}
    for name in PROJECTIONS + (SUB_ROUTER if sub else ()):
        arrays = [np.asarray(layer_value(model, l, "mlp", name), np.float32) for l in layers]
        if name in PROJECTIONS:
            arrays = [a.reshape(-1, max(sub, 1), *a.shape[1:]) for a in arrays]
        out[name] = np.concatenate(arrays)
    return out


def expert_weights(model, layers) -> list[np.ndarray]:
    """[gate, up, down] of the units of `layers` (`unit_weights`' first three)."""
    ws = unit_weights(model, layers)
    return [ws[p] for p in PROJECTIONS]


def copy_plan(layers, prototypes, owner_of_slot, num_experts) -> ScopePlan:
    """A plan whose table rows are the original experts `prototypes` (scope indices) and
    whose slot of scope expert i goes to row `owner_of_slot[i]` (-1: pruned). `num_experts`:
    the slots of every layer, or of each layer (a list: layers of a per-layer conversion
    differ in their routed expert count)."""
    sizes = [num_experts] * len(layers) if np.isscalar(num_experts) else list(num_experts)
    mix = np.zeros((len(prototypes), sum(sizes)))
    mix[np.arange(len(prototypes)), prototypes] = 1.0
    owner = np.split(np.asarray(owner_of_slot, np.int32), np.cumsum(sizes)[:-1])
    return ScopePlan(list(layers), mix, {l: owner[j] for j, l in enumerate(layers)})


def scopes_of(moe_layers: list[int], size: int) -> list[list[int]]:
    return [moe_layers[i:i + size] for i in range(0, len(moe_layers), size)]


def conmoe_plans(model, stats: dict, ratio: float, scope: int, selection: str = "adaptive",
                 distance: str = "weights"):
    """ConMoE plans of every scope of `scope` consecutive MoE layers, and distance figures.

    `distance` "weights" is the paper's d (gate/up/down Frobenius distances); "outputs" the
    same normalised distance between the experts' mean calibration outputs (`mean_out`),
    which tells experts apart by what they add to the residual stream, not by their weights."""
    if distance not in scoring.DISTANCES:
        raise ValueError(f"distance {distance!r} must be one of {', '.join(scoring.DISTANCES)}")
    moe_layers = sorted(stats)
    counts = {l: len(stats[l].freq) for l in moe_layers}  # units (top-level experts) per layer
    plans, spread, cross = [], [], []
    for layers in scopes_of(moe_layers, scope):
        dist = scoring.frobenius_distance(
            expert_weights(model, layers) if distance == "weights"
            else [np.concatenate([stats[l].mean_out for l in layers])])
        sizes = [counts[l] for l in layers]
        layer_of = np.repeat(np.arange(len(layers)), sizes)
        contrib = np.concatenate([stats[l].contrib for l in layers])
        freq = np.concatenate([stats[l].freq for l in layers])
        sel = scoring.select(contrib, dist, freq, layer_of, ratio, selection)
        plan = copy_plan(layers, sel["prototypes"], scoring.assign(dist, sel["prototypes"]), sizes)
        off = dist[~np.eye(len(dist), dtype=bool)]
        plan.info = {"prototypes": sel["prototypes"].tolist(), "a": sel["a"].tolist(),
                     "b": sel["b"].tolist(), "score": sel["score"].tolist(),
                     "freq": freq.tolist(),
                     "distance": {"min": float(off.min()), "max": float(off.max()),
                                  "mean": float(off.mean()), "std": float(off.std())}
                     if off.size else None}
        plans.append(plan)
        spread.append(off)
        cross.append(scoring.cross_layer_fraction(dist, layer_of) * len(layer_of))
    allv = np.concatenate(spread) if spread else np.zeros(0)
    n_total = sum(counts.values())
    figures = {"cross_layer_nn_fraction": float(sum(cross) / n_total),
               "distance_min": float(allv.min()) if allv.size else None,
               "distance_max": float(allv.max()) if allv.size else None,
               "distance_mean": float(allv.mean()) if allv.size else None,
               "distance_std": float(allv.std()) if allv.size else None}
    return plans, figures

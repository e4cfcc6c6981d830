"""Reading back a carved model that `export` wrote for transformers' remote code.

A carved (or compressed) model has no class of its own in transformers: `export` writes the
base family's config under `model_type` "cmoe_<family>" with every layer's MoE shape in
`moe_layers` (an `FFNSpec`'s fields, plus the router's arrays for the remote code), and the
MoE layers' tensors under their cmoe_jax names and layouts (`model.layers.N.mlp.<leaf>`).
Here that config is read back into the family's config with its MoE layers, so `eval`,
`generate` and `train` read an export as they read the model it was exported from.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from cmoe_jax.models import config_fields
from cmoe_jax.moe.spec import FFNSpec

PREFIX = "cmoe_"  # an exported carved model's model_type: PREFIX + the family's
REMOTE_ONLY = ("router_params",)  # what the remote code alone reads of a layer


def is_carved_export(model_type: str, get: Callable) -> bool:
    return model_type.startswith(PREFIX) and get("moe_layers") is not None


def base_getter(get: Callable) -> Callable:
    """`get` of the family the export was carved from (its model_type without the prefix)."""
    base = get("model_type").removeprefix(PREFIX)
    return lambda k, default=None: base if k == "model_type" else get(k, default)


def exported_moe_layers(get: Callable, where) -> tuple[FFNSpec | None, ...]:
    """The MoE shape of every layer, checked field by field (one line naming the field)."""
    layers, count = get("moe_layers"), get("num_hidden_layers")
    if not isinstance(layers, list) or len(layers) != count:
        config_fields.fail(where, "moe_layers", layers, f"a list of one MoE layer spec or null per layer ({count})")
    specs = []
    for i, layer in enumerate(layers):
        if layer is None:
            specs.append(None)
            continue
        if not isinstance(layer, dict):
            config_fields.fail(where, f"moe_layers[{i}]", layer, "an MoE layer spec (an object) or null")
        fields = {k: v for k, v in layer.items() if k not in REMOTE_ONLY}
        config_fields.check_spec(fields, where, f"moe_layers[{i}].", dataclasses.fields(FFNSpec))
        specs.append(FFNSpec(**fields))
    return tuple(specs)

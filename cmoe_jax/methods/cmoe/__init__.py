"""CMoE: carve each dense SwiGLU FFN into shared and routed experts with an analytical router.

`convert_model` converts a loaded model in memory; `convert_streamed` reads one layer at a
time from the checkpoint. `MoEPlan` is the SxAyEz configuration. `carve_ffn` carves one FFN
of your own (its weights and calibration inputs) into a filled `MoEFFN` in one call.

The carving names load with the package; the conversion job's (its report, budget search,
streamed conversion, settings and steps, `METHOD`) on first use (PEP 562), so
`from cmoe_jax import carve_ffn`, a library call, loads what carving one FFN needs and not
the job's checkpoint, dataset and GGUF libraries.
"""
import importlib

from cmoe_jax.methods.cmoe.carve import LayerCarving, carve_layer, slice_ffn
from cmoe_jax.methods.cmoe.carve_ffn import carve_ffn
from cmoe_jax.methods.cmoe.convert import (ConversionError, ConvertConfig, LayerRecord, carve_profiled,
                                           check_router, conversion_mesh, convert_model)
from cmoe_jax.methods.cmoe.plan import MoEPlan
from cmoe_jax.methods.cmoe.router import (gate_fit_sums, representative_neurons, router_fit_sums,
                                          router_weights, scale_router_up, solve_gate_scales)
from cmoe_jax.methods.cmoe.shared import split_shared

_MODULES = {  # loaded on first use
    "report": ("band_table", "layer_table", "plot_expert_load", "write_report"),
    "budget": ("Budget", "BudgetError", "adaptive_config", "measure_damage"),
    "streamed": ("Streamed", "convert_streamed"),
    "job": ("CmoeSteps", "ConvertSettings", "base_manifest", "check_context", "is_dense", "stage_seconds"),
}
_WHERE = {name: f"{__name__}.{module}" for module, names in _MODULES.items() for name in names}


def _method():
    """The method as the convert command registers it (`cmoe_jax.methods.registry`)."""
    from cmoe_jax.methods.cmoe import flags
    from cmoe_jax.methods.cmoe.job import ConvertSettings, CmoeSteps, is_dense
    from cmoe_jax.methods.method import Method

    return Method(name="cmoe", command="convert", choices=("cmoe",), title="CMoE",
                  summary="cmoe (CMoE; hierarchical when --model is an MoE)",
                  settings=ConvertSettings, steps=CmoeSteps, add_flags=flags.add_flags,
                  from_args=flags.settings_from_args, check_args=flags.check_args, takes_source=is_dense)


def __getattr__(name: str):
    if name == "METHOD":
        value = _method()
    elif name == "flags":
        value = importlib.import_module(f"{__name__}.flags")
    elif name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = ["LayerCarving", "carve_layer", "slice_ffn", "carve_ffn", "ConversionError", "ConvertConfig",
           "LayerRecord", "carve_profiled", "check_router", "conversion_mesh", "convert_model", "MoEPlan",
           "gate_fit_sums", "representative_neurons", "router_fit_sums", "router_weights",
           "scale_router_up", "solve_gate_scales", "split_shared", *_WHERE, "flags", "METHOD"]


def __dir__():
    return sorted(set(globals()) | set(__all__))

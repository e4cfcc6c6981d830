"""CMoE conversion: the job API (`convert`), the in-memory API (`convert_model`) and checkpoints."""
from cmoe_jax.checkpoint import read_manifest, save_converted
from cmoe_jax.convert.api import convert as _convert
from cmoe_jax.loading import load_converted
from cmoe_jax.methods.cmoe import (
    ConversionError,
    ConvertConfig,
    LayerRecord,
    convert_model,
)


def convert(*args, **kwargs):
    return _convert(*args, **kwargs)


__all__ = ["convert", "convert_model", "ConvertConfig", "ConversionError", "LayerRecord",
           "load_converted", "read_manifest", "save_converted"]

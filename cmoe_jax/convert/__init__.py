"""CMoE conversion: the job (`convert` with a `ConvertJob`), the in-memory API
(`convert_model`) and checkpoints."""
from cmoe_jax.checkpoint import read_manifest, save_converted
from cmoe_jax.convert.api import Calibration, ConvertJob, convert
from cmoe_jax.loading import load_converted
from cmoe_jax.methods.cmoe import ConversionError, ConvertConfig, LayerRecord, convert_model

__all__ = ["convert", "ConvertJob", "Calibration", "convert_model", "ConvertConfig", "ConversionError",
           "LayerRecord", "load_converted", "read_manifest", "save_converted"]

"""Conversion: the job (`convert` with a `ConvertSettings` or a `WeaverSettings`), the
in-memory API (`convert_model`) and checkpoints."""
from cmoe_jax.checkpoint import read_manifest, save_converted
from cmoe_jax.convert.api import convert
from cmoe_jax.data import Calibration
from cmoe_jax.loading import load_converted
from cmoe_jax.methods.cmoe import ConversionError, ConvertConfig, LayerRecord, convert_model
from cmoe_jax.methods.cmoe.job import ConvertSettings
from cmoe_jax.methods.expertweaver import TaskCalibration, WeaveConfig, WeaverSettings

__all__ = ["convert", "ConvertSettings", "Calibration", "convert_model", "ConvertConfig", "ConversionError",
           "LayerRecord", "load_converted", "read_manifest", "save_converted", "TaskCalibration",
           "WeaveConfig", "WeaverSettings"]

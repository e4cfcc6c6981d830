"""`python -m cmoe_jax.compress`: the compression job (the methods are `cmoe_jax.methods.conmoe`)."""
from cmoe_jax.compress.api import compress
from cmoe_jax.data import Calibration
from cmoe_jax.methods.conmoe import COMPRESS_METHODS as METHODS, CompressConfig, CompressSettings

__all__ = ["Calibration", "CompressConfig", "CompressSettings", "METHODS", "compress"]

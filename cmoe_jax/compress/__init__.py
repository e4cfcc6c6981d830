"""`python -m cmoe_jax.compress`: the ConMoE compression job (the method is `cmoe_jax.methods.conmoe`)."""
from cmoe_jax.compress.api import CompressConfig, compress

__all__ = ["CompressConfig", "compress"]

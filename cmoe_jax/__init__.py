"""cmoe_jax: training-free dense-to-MoE conversion (CMoE, ExpertWeaver) in JAX/Flax NNX."""
from cmoe_jax.errors import CmoeError
from cmoe_jax.loading import load_model
from cmoe_jax.models import Decoder, FFNSpec, ModelConfig

__all__ = ["CmoeError", "load_model", "Decoder", "FFNSpec", "ModelConfig"]

"""Flax NNX decoders for the families of `cmoe_jax.models.families`."""
from cmoe_jax.models.config import SUPPORTED_MODEL_TYPES, FFNSpec, ModelConfig, rope_inv_freq
from cmoe_jax.models.decoder import Decoder, DecoderLayer
from cmoe_jax.models.layers import Attention, RMSNorm, SwiGLU

__all__ = ["SUPPORTED_MODEL_TYPES", "FFNSpec", "ModelConfig", "rope_inv_freq", "Decoder",
           "DecoderLayer", "Attention", "RMSNorm", "SwiGLU"]

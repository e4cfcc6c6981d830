"""Flax NNX decoders for Llama, Qwen2, Qwen3, Qwen3-MoE and Mixtral checkpoints."""
from cmoe_jax.models.config import SUPPORTED_MODEL_TYPES, FFNSpec, ModelConfig, rope_inv_freq
from cmoe_jax.models.decoder import Decoder, DecoderLayer
from cmoe_jax.models.layers import Attention, RMSNorm, SwiGLU

__all__ = ["SUPPORTED_MODEL_TYPES", "FFNSpec", "ModelConfig", "rope_inv_freq", "Decoder",
           "DecoderLayer", "Attention", "RMSNorm", "SwiGLU"]

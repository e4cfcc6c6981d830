"""cmoe_jax: training-free dense-to-MoE conversion (CMoE, ExpertWeaver) in JAX/Flax NNX."""
import os

# A core install has no torch by design; transformers (used here for configs and tokenizers
# only) would otherwise print an advisory "PyTorch was not found" line on every run.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from cmoe_jax.errors import CmoeError
from cmoe_jax.loading import load_model
from cmoe_jax.models import Decoder, FFNSpec, ModelConfig

__all__ = ["CmoeError", "load_model", "Decoder", "FFNSpec", "ModelConfig"]

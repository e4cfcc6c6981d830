"""cmoe_jax: training-free dense-to-MoE conversion (CMoE, ExpertWeaver) in JAX/Flax NNX.

The top-level names load lazily, so `import cmoe_jax.moe` (the MoE layer alone) does not
pull in the checkpoint, tokenizer and dataset libraries that `load_model` needs.
"""
import importlib
import os

# A core install has no torch by design; transformers (used here for configs and tokenizers
# only) would otherwise print an advisory "PyTorch was not found" line on every run.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

_LAZY = {"CmoeError": "cmoe_jax.errors", "load_model": "cmoe_jax.loading",
         "Decoder": "cmoe_jax.models", "FFNSpec": "cmoe_jax.models", "ModelConfig": "cmoe_jax.models",
         "MoEFFN": "cmoe_jax.moe", "carve_ffn": "cmoe_jax.methods.cmoe"}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'cmoe_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))

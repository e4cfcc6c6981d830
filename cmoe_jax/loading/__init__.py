"""Checkpoint loading: Hugging Face safetensors / .bin, GGUF, Hub ids and the embedded default."""
from cmoe_jax.loading.load import (LoadedModel, load_config, load_converted, load_model, load_weights,
                                   open_model)
from cmoe_jax.loading.sources import open_source
from cmoe_jax.loading.tokenizer import Tokenizer, load_tokenizer, window_bos
from cmoe_jax.loading.zoo import DEFAULT_MODEL, resolve, smollm2_gguf

__all__ = ["LoadedModel", "load_config", "load_converted", "load_model", "load_weights", "open_model",
           "open_source", "Tokenizer", "load_tokenizer", "window_bos", "DEFAULT_MODEL", "resolve", "smollm2_gguf"]

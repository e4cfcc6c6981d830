"""The `transformers` side of the benchmarks: the same checkpoint loaded as a torch model."""
from __future__ import annotations

from pathlib import Path


def load_torch_causal_lm(path: Path):
    """float32 `AutoModelForCausalLM` with SDPA attention from a HF directory or a GGUF file."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    kw = dict(dtype=torch.float32, attn_implementation="sdpa")
    if path.suffix == ".gguf":
        return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), **kw)

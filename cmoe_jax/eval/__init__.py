"""Perplexity evaluation (GPTQ convention) as a function and as `python -m cmoe_jax.eval`."""
from cmoe_jax.eval.perplexity import perplexity

__all__ = ["perplexity"]

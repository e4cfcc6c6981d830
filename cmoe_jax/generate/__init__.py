"""Text generation with a KV cache: the engine (`generate`, `Decoding`, `Sampling`) and its
command line (`python -m cmoe_jax.generate`, `cmoe-jax generate`: `main`).

The engine's names load on first use, so the command line checks its arguments before
JAX is imported.
"""
import importlib

from cmoe_jax.generate.cli import main

_ENGINE = ("Decoding", "Sampling", "choose", "generate")

__all__ = ["main", *_ENGINE]


def __getattr__(name: str):
    if name not in _ENGINE:
        raise AttributeError(f"module 'cmoe_jax.generate' has no attribute {name!r}")
    value = getattr(importlib.import_module("cmoe_jax.generate.engine"), name)
    globals()[name] = value
    return value

"""The GLU activations of the supported families, by name.

A family's FFN is `down(act(x W_gate) * (x W_up))`; Llama, Qwen and Mistral use SiLU, Gemma
the tanh approximation of GELU. Every module that evaluates an FFN, an expert or a router
neuron takes the activation by name from the model's config and looks it up here.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax

_ACTIVATIONS: dict[str, Callable] = {
    "silu": jax.nn.silu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
}
# transformers' `hidden_act` / `hidden_activation` names of the same functions
_HF_NAMES = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
             "gelu_new": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu"}
ACTIVATIONS = tuple(_ACTIVATIONS)


def glu_activation(name: str) -> Callable:
    """The activation function called `name` (one of `ACTIVATIONS`)."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"unknown GLU activation {name!r} (known: {', '.join(ACTIVATIONS)})")
    return _ACTIVATIONS[name]


def from_hf_name(hf_name: str) -> str:
    """Our name of a transformers activation name ("gelu_pytorch_tanh" -> "gelu_tanh")."""
    if hf_name not in _HF_NAMES:
        raise ValueError(f"unsupported activation {hf_name!r} (supported: {', '.join(_HF_NAMES)})")
    return _HF_NAMES[hf_name]


def to_hf_name(name: str) -> str:
    """The transformers name of our activation `name` ("gelu_tanh" -> "gelu_pytorch_tanh")."""
    return {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}[name]

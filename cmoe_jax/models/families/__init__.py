"""The supported decoder families, one unit each, by `model_type`.

Adding a family: docs/guides/adding-a-family.md.
"""
from __future__ import annotations

from cmoe_jax.errors import UnsupportedModelError
from cmoe_jax.models.families.base import Family
from cmoe_jax.models.families.gemma3 import GEMMA3_TEXT
from cmoe_jax.models.families.llama import LLAMA, MISTRAL
from cmoe_jax.models.families.mixtral import MIXTRAL
from cmoe_jax.models.families.olmoe import OLMOE
from cmoe_jax.models.families.phi3 import PHI3
from cmoe_jax.models.families.qwen import QWEN2, QWEN3, QWEN3_MOE
from cmoe_jax.models.families.qwen2_moe import QWEN2_MOE

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA3_TEXT, PHI3, QWEN3_MOE, MIXTRAL, OLMOE, QWEN2_MOE)}
GUIDE = "docs/guides/adding-a-family.md"
# model types that hold a supported text model inside a larger one
_WRAPPERS = {"gemma3": "gemma3_text"}


def family(model_type: str) -> Family:
    """The unit of `model_type`; an unsupported type raises naming the supported ones."""
    if model_type in _WRAPPERS:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is a multimodal checkpoint: cmoe_jax reads its text "
            f"model only as {_WRAPPERS[model_type]!r} (a text-only checkpoint or GGUF)")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}: cmoe_jax supports "
            f"{', '.join(FAMILIES)} ({GUIDE} says how to add a family)")
    return FAMILIES[model_type]


def by_gguf_arch(arch: str, experts: bool = False) -> Family:
    """The unit llama.cpp's `general.architecture` `arch` names; `experts`: the file has MoE
    layers (llama.cpp writes Mixtral as a "llama" with expert tensors)."""
    found = [f for f in FAMILIES.values() if f.gguf_arch == arch]
    if found:
        return next((f for f in found if f.gguf_moe == experts), found[0])
    known = [f.gguf_arch for f in FAMILIES.values() if f.gguf_arch]
    raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r}: cmoe_jax reads GGUF "
                                f"files of {', '.join(known)} ({GUIDE} says how to add a family)")


__all__ = ["FAMILIES", "Family", "GUIDE", "by_gguf_arch", "family"]

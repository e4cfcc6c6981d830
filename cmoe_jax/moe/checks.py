"""An MoE layer's refusals, each in one line: a shape or setting it cannot build, an input or
a token mask it cannot run."""
from __future__ import annotations

import jax.numpy as jnp

from cmoe_jax.moe.gmm import resolve_backend

# a layer's `dispatch`: "auto" (`cmoe_jax.moe.modes` picks per call) or one forced path
DISPATCHES = ("auto", "sort", "gather", "dense", "padded")


def check_input(x, d_model: int, owner: str = "MoEFFN") -> None:
    """Refuse an input that is not floating point `[..., d_model]` with one line naming both
    widths (a wrong width would otherwise be silently regrouped into tokens)."""
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) == 0:
        raise ValueError(f"{owner} expects an array [..., d_model={d_model}], got "
                         f"{type(x).__name__} of shape {shape}")
    if shape[-1] != d_model:
        raise ValueError(f"{owner} was built for d_model={d_model} but the input's last "
                         f"dimension is {shape[-1]} (shape {tuple(shape)})")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{owner} expects a floating-point input, got dtype {x.dtype}")


def check_mask(mask, lead_shape: tuple, owner: str = "MoEFFN"):
    """The token mask as bool `[T]` (None stays None); refuses one whose shape is not the
    input's leading shape."""
    if mask is None:
        return None
    shape = tuple(getattr(mask, "shape", ()))
    if shape != tuple(lead_shape):
        raise ValueError(f"{owner}'s mask must have the input's leading shape {tuple(lead_shape)} "
                         f"(True: a real token, False: padding), got shape {shape}")
    return jnp.asarray(mask).astype(bool).reshape(-1)


def check_layer(d_model: int, spec, backend, dispatch: str) -> None:
    """Refuse a layer's shape or settings in one line each, before anything is built."""
    if min(d_model, spec.expert_width, spec.num_experts) < 1 or spec.shared_width < 0:
        raise ValueError(f"d_model={d_model}, expert_width={spec.expert_width} and num_experts="
                         f"{spec.num_experts} must be positive, shared_width={spec.shared_width} >= 0")
    if not spec.capacity_factor >= 0:
        raise ValueError(f"capacity_factor={spec.capacity_factor} must be >= 0 (0: no capacity limit)")
    if spec.skip_compensation and (spec.router != "cmoe" or spec.sub_experts):
        raise ValueError("skip_compensation predicts skipped experts from the cmoe router's neurons: "
                         f"it needs router='cmoe' and no sub-experts (got router={spec.router!r}, "
                         f"sub_experts={spec.sub_experts})")
    if spec.threshold_routing and (spec.sub_experts or spec.num_prototypes):
        raise ValueError("threshold_routing runs a token's experts whose scores reach the layer's "
                         "threshold: it needs a plain cmoe layer (no sub-experts, no prototypes)")
    if not callable(backend):
        resolve_backend(backend)  # fail early on a typo
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")

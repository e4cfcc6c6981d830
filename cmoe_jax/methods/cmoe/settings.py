"""What a CMoE conversion job is asked for, as one object passed whole: the carving
(`ConvertConfig`: a uniform plan, or None when a budget chooses each layer's), the budget
(`Budget`, or None for a plan), the calibration text and how to run."""
from __future__ import annotations

import dataclasses

from cmoe_jax.data import Calibration
from cmoe_jax.methods.cmoe.budget import Budget
from cmoe_jax.methods.cmoe.config import ConvertConfig


@dataclasses.dataclass(frozen=True)
class ConvertSettings:
    """Everything a CMoE conversion needs besides its model and output: the method's
    settings, the calibration text, and how to run (the CLI builds it from its flags)."""

    method: ConvertConfig
    calibration: Calibration = Calibration()
    stream: bool = False  # read, convert and write one layer at a time (dense sources)
    expert_parallel: int = 1  # devices the routed experts are split over in the forward
    min_expert_tokens: int = 32  # hierarchical: fewer routed tokens -> profile on all tokens
    report: bool = False  # PNG plots and a JSON summary beside the model
    budget: Budget | None = None  # `--active F`: each layer's shape chosen for the budget

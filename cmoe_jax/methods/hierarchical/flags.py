"""Hierarchical CMoE's own flag (the CMoE flags describe the rest of its settings)."""
from __future__ import annotations

from cmoe_jax.cli_args import positive_int


def add_flags(g) -> None:
    g.add_argument("--min-expert-tokens", type=positive_int, default=32,
                   help="MoE source (hierarchical CMoE): an expert reached by fewer calibration "
                        "tokens is profiled on all tokens")

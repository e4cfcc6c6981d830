"""SxAyEz plan: parsing, derived sizes, and every validation error."""
from __future__ import annotations

import numpy as np
import pytest

from cmoe_jax.methods.cmoe import MoEPlan


@pytest.mark.parametrize("text, xyz", [("S1A1E8", (1, 1, 8)), ("S2A2E16", (2, 2, 16)),
                                       ("S3A3E8", (3, 3, 8)), ("S3A9E16", (3, 9, 16)), (" S0A2E8 ", (0, 2, 8))])
def test_parse(text, xyz):
    p = MoEPlan.parse(text)
    assert (p.shared, p.active, p.total) == xyz
    assert p == MoEPlan(*xyz) and p.name == text.strip()


def test_sizes_llama7b():
    p = MoEPlan.parse("S3A9E16")
    assert (p.routed, p.expert_width(11008), p.shared_width(11008)) == (13, 688, 3 * 688)
    p = MoEPlan.parse("S1A1E8")
    assert (p.routed, p.expert_width(11008), p.shared_width(11008)) == (7, 1376, 1376)


@pytest.mark.parametrize("text", ["E8", "S1A1", "s1a1e8", "S1A1E8x", "S-1A1E8", "", "S1.5A1E8"])
def test_parse_rejects(text):
    with pytest.raises(ValueError, match="SxAyEz"):
        MoEPlan.parse(text)


@pytest.mark.parametrize("plan, d_h, k_act, message", [
    (MoEPlan(1, 1, 7), 64, 4, "do not divide"),
    (MoEPlan(1, 8, 8), 64, 4, "exceed"),
    (MoEPlan(3, 6, 8), 64, 4, "exceed"),
    (MoEPlan(8, 1, 8), 64, 4, "fewer than"),
    (MoEPlan(9, 1, 8), 64, 4, "fewer than"),
    (MoEPlan(1, 1, 8), 64, 65, "K_a"),
    (MoEPlan(1, 1, 8), 64, 0, "K_a"),
    (MoEPlan(1, 0, 8), 64, 4, "positive"),
    (MoEPlan(0, 1, 0), 64, 4, "positive"),
    (MoEPlan(1, 1, -8), 64, 4, "positive"),
    (MoEPlan(-1, 1, 8), 64, 4, ">= 0"),
    (MoEPlan(1, 1, 8), 0, 4, "d_h"),
    (MoEPlan(1, 1, 8), 64.0, 4, "integer"),
    (MoEPlan(1, 1, 8), 64, 2.5, "integer"),
])
def test_validation_errors(plan, d_h, k_act, message):
    with pytest.raises(ValueError, match=message):
        plan.validate(d_h, k_act)


@pytest.mark.parametrize("text, d_h", [("S1A1E8", 11008), ("S3A9E16", 11008), ("S0A2E8", 64),
                                       ("S1A7E8", 64), ("S2A2E16", 8192)])
def test_validation_accepts(text, d_h):
    MoEPlan.parse(text).validate(d_h, 10)
    MoEPlan.parse(text).validate(np.int64(d_h), np.int32(10))  # numpy integers are fine


def test_frozen():
    with pytest.raises(Exception):
        MoEPlan(1, 1, 8).shared = 2

"""The SxAyEz configuration: x shared experts, y active routed experts, z experts in all."""
from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class MoEPlan:
    shared: int   # x: always-on experts, fused into one MLP of width x*m
    active: int   # y: routed experts selected per token
    total: int    # z: all experts; routed experts N_r = z - x, expert width m = d_h / z

    @classmethod
    def parse(cls, text: str) -> "MoEPlan":
        match = re.fullmatch(r"S(\d+)A(\d+)E(\d+)", text.strip())
        if not match:
            raise ValueError(f"configuration {text!r} is not of the form SxAyEz (e.g. S1A1E8)")
        return cls(*map(int, match.groups()))

    @property
    def name(self) -> str:
        return f"S{self.shared}A{self.active}E{self.total}"

    @property
    def routed(self) -> int:
        return self.total - self.shared

    def expert_width(self, d_h: int) -> int:
        return d_h // self.total

    def validate(self, d_h: int, k_act: int) -> None:
        """Raise ValueError naming the problem for a plan that cannot carve a d_h-wide FFN."""
        if self.total < 1 or self.shared < 0 or self.active < 1:
            raise ValueError(f"{self.name}: need x >= 0 shared, y >= 1 active and z >= 1 experts")
        if self.shared >= self.total:
            raise ValueError(f"{self.name}: x={self.shared} shared experts must be fewer than "
                             f"z={self.total} experts in all")
        if self.active > self.routed:
            raise ValueError(f"{self.name}: y={self.active} active experts exceed the "
                             f"z - x = {self.routed} routed experts")
        if d_h % self.total:
            raise ValueError(f"{self.name}: z={self.total} experts do not divide the FFN width "
                             f"d_h={d_h}; choose z among the divisors of {d_h}")
        if not 1 <= k_act <= d_h:
            raise ValueError(f"K_a={k_act} markers per token must be between 1 and d_h={d_h}")

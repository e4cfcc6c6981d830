"""The SxAyEz configuration: x shared experts, y active routed experts, z experts in all."""
from __future__ import annotations

import dataclasses
import numbers
import re

from cmoe_jax.errors import InputError


@dataclasses.dataclass(frozen=True)
class MoEPlan:
    """`MoEPlan(1, 1, 8)` or `MoEPlan.parse("S1A1E8")`; checked against a layer by `validate`.

    shared (x): always-on experts, fused into one MLP of width x*m (x = 0 allowed: no shared).
    active (y): routed experts selected per token.
    total (z): all experts; N_r = z - x routed experts of width m = d_h / z.
    """

    shared: int
    active: int
    total: int

    @classmethod
    def parse(cls, text: str, flag: str = "configuration") -> "MoEPlan":
        """The one reader of the SxAyEz syntax (CLI flags, the demo's rows, manifests)."""
        match = re.fullmatch(r"S(\d+)A(\d+)E(\d+)", str(text).strip())
        if not match:
            raise InputError(f"{flag} {text!r} is not of the form SxAyEz (e.g. S1A1E8, S3A3E16)")
        return cls(*map(int, match.groups()))

    @property
    def name(self) -> str:
        return f"S{self.shared}A{self.active}E{self.total}"

    @property
    def routed(self) -> int:
        """N_r = z - x."""
        return self.total - self.shared

    def expert_width(self, d_h: int) -> int:
        """m = d_h / z neurons per expert."""
        return d_h // self.total

    def shared_width(self, d_h: int) -> int:
        """x * m neurons in the fused shared expert."""
        return self.shared * self.expert_width(d_h)

    def validate(self, d_h: int, k_act: int) -> None:
        """Raise InputError (a ValueError) naming the problem for a plan that cannot carve a d_h-wide FFN."""
        for field, value in (("x (shared)", self.shared), ("y (active)", self.active),
                             ("z (experts)", self.total), ("d_h", d_h), ("K_a", k_act)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise InputError(f"{self.name}: {field} must be an integer, got {value!r}")
        if self.shared < 0:
            raise InputError(f"{self.name}: x={self.shared} shared experts must be >= 0")
        if self.total <= 0:
            raise InputError(f"{self.name}: z={self.total} total experts must be positive")
        if d_h <= 0:
            raise InputError(f"FFN width d_h={d_h} must be positive")
        if self.shared >= self.total:
            raise InputError(f"{self.name}: x={self.shared} shared experts must be fewer than "
                             f"z={self.total} experts in all (at least one routed expert)")
        if self.active <= 0:
            raise InputError(f"{self.name}: y={self.active} active routed experts must be positive")
        if self.active > self.routed:
            raise InputError(f"{self.name}: y={self.active} active experts exceed the "
                             f"z - x = {self.routed} routed experts")
        if d_h % self.total:
            raise InputError(f"{self.name}: z={self.total} experts do not divide the FFN width "
                             f"d_h={d_h}; choose z among the divisors of {d_h}")
        if not 1 <= k_act <= d_h:
            raise InputError(f"K_a={k_act} markers per token must be between 1 and d_h={d_h}")

"""The fault hook as the jobs use it (defined in `cmoe_jax.faults`, below every layer that
writes or reads outputs)."""
from cmoe_jax.faults import FAULT_ENV, PAUSE_ENV, fault_point

__all__ = ["FAULT_ENV", "PAUSE_ENV", "fault_point"]

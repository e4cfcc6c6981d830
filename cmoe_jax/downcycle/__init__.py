"""`python -m cmoe_jax.downcycle` and `cmoe-jax downcycle`: weave a dense model into an MoE and
train all of it; the job is `cmoe_jax.downcycle.job`."""
from cmoe_jax.downcycle.job import build_parser, main, parse_args, run

__all__ = ["build_parser", "main", "parse_args", "run"]

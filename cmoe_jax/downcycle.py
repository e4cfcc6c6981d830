"""`python -m cmoe_jax.downcycle` and `cmoe-jax downcycle`: the command's entry point; the job
(weave a dense model into an MoE and train all of it) is `cmoe_jax.train.downcycle`."""
from cmoe_jax.train.downcycle import build_parser, main, parse_args, run

__all__ = ["build_parser", "main", "parse_args", "run"]

if __name__ == "__main__":
    import sys

    sys.exit(main())

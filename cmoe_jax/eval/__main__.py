import sys

from cmoe_jax.eval.cli import main

sys.exit(main())

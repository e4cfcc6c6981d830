import sys

from cmoe_jax.train.cli import main

sys.exit(main())

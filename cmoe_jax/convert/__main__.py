import sys

from cmoe_jax.convert.cli import main

sys.exit(main())

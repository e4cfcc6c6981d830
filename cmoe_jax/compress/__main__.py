import sys

from cmoe_jax.compress.cli import main

sys.exit(main())

import sys

from cmoe_jax.export.cli import main

sys.exit(main())

import sys

from cmoe_jax.downcycle.cli import main

sys.exit(main())

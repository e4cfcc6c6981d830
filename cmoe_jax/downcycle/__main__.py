import sys

from cmoe_jax.downcycle.job import main

sys.exit(main())

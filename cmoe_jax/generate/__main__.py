from cmoe_jax.generate.cli import main

raise SystemExit(main())

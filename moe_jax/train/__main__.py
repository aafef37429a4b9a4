"""`python -m moe_jax.train` is `moe-jax train`."""

import sys

from moe_jax.cli import main

sys.argv[1:1] = ["train"]
sys.exit(main())

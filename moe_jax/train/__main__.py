"""`python -m moe_jax.train` is `moe-jax train`."""

import sys

from moe_jax.train.train import main

sys.exit(main(sys.argv[1:]))

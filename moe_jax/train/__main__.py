"""`python -m moe_jax.train` is `moe-jax train`."""

import sys

from moe_jax.cli import main

sys.exit(main(["train", *sys.argv[1:]]))

"""Wall time of the whole synthetic quick suite (`moe-jax synthetic all --preset quick`).

Usage: python benchmarks/synthetic_suite.py [--out DIR] [--seeds 0,1]
Prints one line per experiment and a table row for benchmarks/RESULTS.md. Compile times
are included; a warm compilation cache (.cache/jax) makes a second run faster.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "jax"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="results/synthetic-quick")
    parser.add_argument("--seeds", default="0,1")
    args = parser.parse_args()
    from moe_jax.synthetic import cli
    from moe_jax.synthetic.experiments import SUITE

    start = time.perf_counter()
    rc = cli.main(["all", "--preset", "quick", "--seeds", args.seeds, "--out", args.out])
    total = time.perf_counter() - start
    print(f"| synthetic quick suite ({', '.join(SUITE)}; seeds {args.seeds}) | {os.cpu_count()} CPU cores, {platform.machine()} | {total:.0f} s |")
    raise SystemExit(rc)


if __name__ == "__main__":
    main()

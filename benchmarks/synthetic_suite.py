"""Wall time of the synthetic suite, experiment by experiment (`moe-jax synthetic all`).

Usage: python benchmarks/synthetic_suite.py [--preset quick|converged] [--seeds 0,1] [--out DIR]

Runs `moe-jax synthetic <experiment> --preset PRESET` for every experiment of the suite
(all but cifar100) in this process and prints a table of wall times (compile included; a
warm compilation cache, .cache/jax, makes a second run faster). Exits 1 when an
experiment fails.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "jax")
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="quick", choices=("quick", "converged"))
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument(
        "--out", default=None, help="results folder (default results/synthetic-PRESET)"
    )
    args = parser.parse_args()
    from moe_jax.synthetic import cli
    from moe_jax.synthetic.experiments import SUITE

    out = args.out or f"results/synthetic-{args.preset}"
    times, failed = [], []
    for name in SUITE:
        start = time.perf_counter()
        if cli.main([name, "--preset", args.preset, "--seeds", args.seeds, "--out", out]) != 0:
            failed.append(name)
        times.append((name, time.perf_counter() - start))
    print("\n| experiment | wall time (s) |\n|---|---|")
    for name, seconds in times:
        print(f"| {name} | {seconds:.1f} |")
    print(f"| total | {sum(s for _, s in times):.1f} |")
    if failed:
        print(f"failed: {', '.join(failed)}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()

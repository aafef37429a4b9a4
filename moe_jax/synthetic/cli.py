"""`moe-jax synthetic <experiment> [--preset quick|paper] [--seed N | --seeds 0,1,2] [--out DIR]`.

Regenerates one synthetic result of the paper (or `all` of the suite) into ``--out``:
``<name>.json`` (numbers), ``<name>.csv`` (one row per run) and ``<name>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

from moe_jax.synthetic.experiments import EXPERIMENTS, SUITE, load
from moe_jax.synthetic.experiments.common import PRESETS

DEFAULT_SEEDS = {"quick": [0, 1], "converged": [0, 1, 2], "paper": [0, 1, 2]}


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("--seeds is empty")
    return seeds


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-jax synthetic", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", help=f"one of: {', '.join(EXPERIMENTS)}, or 'all' (the suite without cifar100), or 'list'")
    p.add_argument("--preset", default="quick", help="quick (CPU minutes) or paper (the paper's sizes)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--seed", type=int, help="a single seed")
    group.add_argument("--seeds", type=_seeds, help="comma-separated seeds, e.g. 0,1,2 (vmapped in one jit)")
    p.add_argument("--out", default="results/synthetic", help="output directory (default: results/synthetic)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.experiment == "list":
        for name in EXPERIMENTS:
            print(name)
        return 0
    if args.preset not in PRESETS:
        print(f"moe-jax synthetic: unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}", file=sys.stderr)
        return 2
    names = list(SUITE) if args.experiment == "all" else [args.experiment]
    if args.experiment != "all" and args.experiment not in EXPERIMENTS:
        print(f"moe-jax synthetic: unknown experiment {args.experiment!r}; choose one of {', '.join(EXPERIMENTS)}, all, list", file=sys.stderr)
        return 2
    seeds = [args.seed] if args.seed is not None else (args.seeds or DEFAULT_SEEDS[args.preset])
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        import jax

        jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(".cache/jax").resolve()))
    out = pathlib.Path(args.out)
    timings = {}
    for name in names:
        experiment = load(name)
        start = time.perf_counter()
        result = experiment.run(dict(experiment.presets[args.preset]), seeds, out)
        timings[name] = time.perf_counter() - start
        print(f"{name}: {timings[name]:.1f}s -> {result['files']['json']}", flush=True)
    if len(names) > 1:
        print(json.dumps({"total_s": round(sum(timings.values()), 1), "per_experiment_s": {k: round(v, 1) for k, v in timings.items()}}))
    return 0
